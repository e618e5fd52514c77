"""The typed pipeline file of ``llmctl check``: a model, the steps to run on it, the gates.

    model: smollm2-135m                  # what every candidate is made from (and the
                                         # eval reference unless eval.reference says)
    quantize:                            # optional: without it the model is the candidate
      matrix: [w4a16-rtn, w4a16-gptq]    # or `recipe: w4a16-gptq` for one candidate
      samples: 32                        # calibration (as `llmctl quantize`)
      seq_len: 256
    build: {target: onnx, precision: int4} # optional: serve and eval the built engine
    serve: {dtype: auto}                 # or `endpoint: http://host:port` (no quantize)
    bench:                               # workloads, each run `repeat` times
      - {name: chat, num_prompts: 16, input_len: 128, output_len: 32, repeat: 3}
    eval: {data: builtin:pydoc-heldout, max_windows: 8}
    gates:
      - mean_kld<=0.2                              # quality, as `llmctl eval --gate`
      - bench.chat.output_throughput>=0.9*baseline # speed, against --baseline REPORT.json

Every mapping rejects keys it does not know, naming the ones it allows. Gate metrics are
the eval report's (``ppl``, ``ppl_ratio``, ``mean_kld``, ``task.NAME.acc``, ...),
``bench.WORKLOAD.METRIC`` (the median over the workload's rounds of a ``llmctl bench``
metric, e.g. ``output_throughput``, ``p99_ttft_ms``) and ``size.checkpoint_bytes``.
"""

from __future__ import annotations

import inspect
import math
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmctl.errors import UsageError
from llmctl.gates import Gate, parse_gate

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


class PipelineError(UsageError):
    """A pipeline file that does not validate (exit 2)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Candidate(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="the candidate's name in reports and "
                      "gate results")
    recipe: str = Field(description="recipe name from recipes/ or a YAML file")


class QuantizeStep(_Strict):
    recipe: str | None = Field(None, description="one recipe (name from recipes/ or a YAML "
                               "file): one candidate")
    matrix: list[str | Candidate] | None = Field(
        None, description="recipes to compare, each a name/file or {name, recipe}; every "
        "candidate is quantized, served, benched and evaluated")
    calibration: str | None = Field(None, description="calibration text: file, hf:NAME or "
                                    "builtin:NAME (default builtin:pydoc-calib)")
    samples: int = Field(128, ge=1, description="calibration windows")
    seq_len: int = Field(512, ge=2, description="tokens per calibration window")
    seed: int = Field(0, description="seed for drawing the calibration windows")
    calib_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        "auto", description="dtype of the calibration activations (auto: bfloat16 on a GPU "
        "or a CPU with native bf16, else float32)")

    @model_validator(mode="after")
    def _one_source(self) -> QuantizeStep:
        if (self.recipe is None) == (self.matrix is None):
            raise ValueError("give exactly one of 'recipe' (one candidate) or 'matrix' "
                             "(a list of recipes to compare)")
        if self.matrix is not None and not self.matrix:
            raise ValueError("'matrix' is empty")
        return self

    def candidates(self) -> list[Candidate]:
        """Named candidates: a recipe given by name keeps it, a file its stem."""
        entries = [self.recipe] if self.recipe is not None else list(self.matrix or [])
        found = [e if isinstance(e, Candidate) else Candidate(name=Path(e).stem, recipe=e)
                 for e in entries]
        names = [c.name for c in found]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise PipelineError(f"quantize.matrix: candidate name(s) {', '.join(twice)} "
                                "appear twice", "give each a distinct {name, recipe}")
        return found


class BuildStep(_Strict):
    target: str = Field(description="`llmctl build-engine --target`: onnx | torch-compile | "
                        "tensorrt-llm")
    precision: str | None = Field(None, description="`--precision` (default: the target's "
                                  "first, e.g. onnx fp32)")
    device: Literal["cpu", "cuda"] = Field("cpu", description="what the engine runs on")
    max_batch_size: int = Field(16, ge=1, le=4096, description="largest decode batch the "
                                "engine takes")
    max_seq_len: int | None = Field(None, ge=16, description="longest sequence (prompt + "
                                    "output)")
    options: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="target options (`--option KEY=VALUE`), e.g. "
        "{block_size: 32}")

    @field_validator("target")
    @classmethod
    def _known(cls, target: str) -> str:
        from llmctl.engines.targets import TARGETS

        if target not in TARGETS:
            raise ValueError(f"unknown target {target!r}: use one of {', '.join(TARGETS)}")
        return target

    def option_strings(self) -> dict[str, str]:
        """The options as `--option` would give them (the target's model parses them)."""
        return {k: str(v).lower() if isinstance(v, bool) else str(v)
                for k, v in self.options.items()}


class ServeStep(_Strict):
    endpoint: str | None = Field(None, description="URL of an already-running OpenAI-"
                                 "compatible server to measure instead (no quantize step)")
    dtype: str = Field("auto", description="`llmctl serve --dtype` (auto: bf16 where the CPU "
                       "computes it natively); not with build (build.precision decides)")
    args: str | None = Field(None, description="more `llmctl serve` options, e.g. "
                             "\"--max-num-seqs 32\"")
    timeout: float = Field(600.0, gt=0, description="seconds to wait for the server's /health")


class Workload(_Strict):
    name: str = Field(pattern=NAME_PATTERN, description="gate metrics are bench.NAME.METRIC")
    dataset: str = Field("random", description="`llmctl bench --dataset`: random | sharegpt | "
                         "jsonl | prefix | long-context")
    num_prompts: int = Field(16, ge=1, description="requests per round")
    input_len: int | None = Field(None, ge=1, description="prompt tokens")
    output_len: int | None = Field(None, ge=1, description="max_tokens per request")
    request_rate: float = Field(math.inf, gt=0, description="requests/s (Poisson), or inf")
    max_concurrency: int | None = Field(None, ge=1, description="requests in flight at most")
    ignore_eos: bool = Field(True, description="generate exactly output_len tokens")
    repeat: int = Field(3, ge=1, description="rounds; speed gates against a baseline use "
                        "their spread")
    slos: dict[str, float] = Field(default_factory=dict, description="goodput SLOs, e.g. "
                                   "{ttft_ms: 500, tpot_ms: 50}")
    seed: int = Field(0, description="seed of the prompts and arrival times")
    request_timeout: float = Field(600.0, gt=0, description="seconds per request")

    @field_validator("request_rate", mode="before")
    @classmethod
    def _inf(cls, value):
        return math.inf if isinstance(value, str) and value.strip().lower() == "inf" else value


class EvalStep(_Strict):
    reference: str | None = Field(None, description="the reference model (default: the "
                                  "pipeline's model)")
    data: str | None = Field("builtin:pydoc-heldout", description="held-out text for "
                             "perplexity and KL divergence (null: tasks only)")
    ctx: int = Field(512, ge=2, description="tokens per window")
    max_windows: int | None = Field(8, ge=1, description="windows scored at most")
    top_k: int = Field(64, ge=1, description="reference tokens kept per position for KLD")
    tasks: list[str] = Field(default_factory=list, description="multiple-choice tasks "
                             "(builtin, or names); their reference runs too, for delta gates")
    task_limit: int | None = Field(None, ge=1, description="items per task at most")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype both models are evaluated in")
    threads: int | None = Field(None, ge=1, description="torch threads (default: all cores)")

    @model_validator(mode="after")
    def _something(self) -> EvalStep:
        if not self.data and not self.tasks:
            raise ValueError("nothing to evaluate: give 'data' and/or 'tasks'")
        return self


class Pipeline(_Strict):
    model: str = Field(description="what every candidate is made from: HF directory, .gguf, "
                       "hub id or smollm2-135m")
    quantize: QuantizeStep | None = Field(None, description="without it the model itself "
                                          "(or serve.endpoint) is the one candidate")
    build: BuildStep | None = Field(None, description="an engine built from each candidate; "
                                    "serve and eval then run the engine")
    serve: ServeStep = Field(default_factory=ServeStep, description="how candidates are "
                             "served for bench")
    bench: list[Workload] = Field(default_factory=list, description="workloads, run in order "
                                  "against each candidate's server")
    eval: EvalStep | None = Field(None, description="quality against the reference")
    gates: list[str] = Field(default_factory=list, description="`llmctl eval` gate strings; "
                             "bench.W.METRIC, size.checkpoint_bytes; *reference, *baseline")

    @field_validator("gates")
    @classmethod
    def _parse(cls, texts: list[str]) -> list[str]:
        for text in texts:
            parse_gate(text)  # GateError (a UsageError) names the malformed one
        return texts

    @model_validator(mode="after")
    def _consistent(self) -> Pipeline:
        names = [w.name for w in self.bench]
        if len(set(names)) != len(names):
            raise ValueError("bench workload names must be distinct")
        if self.serve.endpoint and self.quantize is not None:
            raise ValueError("serve.endpoint measures a server you started: it cannot serve "
                             "the checkpoints 'quantize' makes (drop one of them)")
        if self.serve.endpoint and self.build is not None:
            raise ValueError("serve.endpoint measures a server you started: it cannot serve "
                             "the engine 'build' makes (drop one of them)")
        if self.build is not None and "dtype" in self.serve.model_fields_set:
            raise ValueError("serve.dtype: an engine computes in the precision it was built "
                             "with: set build.precision instead")
        if self.serve.endpoint and self.bench == [] and self.eval is None:
            raise ValueError("serve.endpoint given but nothing uses it (add bench or eval)")
        return self

    def parsed_gates(self) -> list[Gate]:
        return [parse_gate(t) for t in self.gates]


_SHAPE_MISMATCH = ("string_type", "model_type", "dict_type", "model_attributes_type")


def _location(loc: tuple) -> str:
    text = ""
    for part in loc:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part in ("str", "Candidate", "function-after[_one_source(), QuantizeStep]"):
            continue  # pydantic's union-member labels, not keys of the file
        else:
            text += f".{part}" if text else str(part)
    return text or "(top level)"


def _model_in(annotation) -> type[BaseModel] | None:
    """The pydantic model inside an annotation (``X | None``, ``list[str | X]``, ...)."""
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _allowed(loc: tuple) -> str:
    """The keys allowed where an unknown key was found."""
    model: type[BaseModel] = Pipeline
    for part in loc[:-1]:
        if isinstance(part, str) and part in model.model_fields:
            model = _model_in(model.model_fields[part].annotation) or model
    return ", ".join(model.model_fields)


def describe_validation(exc: ValidationError, source: str) -> PipelineError:
    """The first problem as one line naming the key, and what is allowed there. Of a
    union's alternatives (a matrix entry is a recipe name or a {name, recipe} mapping) the
    one that matches the input's shape speaks: an unknown key before a type mismatch."""
    errors = exc.errors()
    first = min(errors, key=lambda e: (e["type"] != "extra_forbidden",
                                       e["type"] in _SHAPE_MISMATCH))
    loc = tuple(first.get("loc", ()))
    where = _location(loc)
    if first["type"] == "extra_forbidden":
        return PipelineError(f"{source}: unknown key {where!r}",
                             f"allowed here: {_allowed(loc)}")
    message = first["msg"].removeprefix("Value error, ")
    value = first.get("input")
    got = f" (got {value!r})" if isinstance(value, (int, float, str)) else ""
    places = {_location(tuple(e.get("loc", ()))) for e in errors
              if e["type"] not in _SHAPE_MISMATCH} - {where}
    more = f"; and {len(places)} more problem(s)" if places else ""
    return PipelineError(f"{source}: {where}: {message[:1].lower() + message[1:]}{got}{more}",
                         "fix the pipeline file (see `llmctl check -h` and examples/)")


def load_pipeline(path: Path) -> Pipeline:
    from llmctl.utils.yaml_file import read_yaml

    _, data = read_yaml(path, PipelineError, what="pipeline file")
    if not isinstance(data, dict):
        raise PipelineError(f"{path} must be a mapping with at least 'model:'",
                            "see examples/check-*.yaml")
    try:
        return Pipeline.model_validate(data)
    except ValidationError as exc:
        raise describe_validation(exc, str(path)) from None


SECTIONS: tuple[tuple[str, type[BaseModel]], ...] = (
    ("(top level)", Pipeline), ("quantize", QuantizeStep), ("quantize.matrix[] entry", Candidate),
    ("build", BuildStep), ("serve", ServeStep), ("bench[] entry", Workload), ("eval", EvalStep))


def keys_markdown() -> str:
    """Every key of the pipeline file with its type, default and meaning (docs/check.md)."""
    lines = []
    for title, model in SECTIONS:
        lines += [f"### {title}", "", "| key | default | meaning |", "|---|---|---|"]
        for name, info in model.model_fields.items():
            default = "required" if info.is_required() else (
                "[]" if info.default_factory is list else
                "{}" if info.default_factory is dict else
                "(see below)" if info.default_factory is not None else repr(info.default))
            meaning = (info.description or "").replace("|", "\\|")  # not a column break
            lines.append(f"| `{name}` | {default} | {meaning} |")
        lines.append("")
    return "\n".join(lines)

