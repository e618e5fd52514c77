"""``llmctl quantize --format gguf``: a Hugging Face checkpoint in, a GGUF file out.

Two engines, chosen per recipe (:meth:`GGUFRecipe.resolved_engine`):

- ``llmctl``: F32/F16/BF16 and the legacy block types (Q8_0, Q4_0, Q4_1, Q5_0,
  Q5_1) are written directly by :mod:`llmctl.gguf.writer`.
- ``llama.cpp``: K-quants and i-quants. llmctl writes a lossless float GGUF
  (the checkpoint's own dtype), optionally computes an importance matrix with
  transformers (:mod:`llmctl.gguf.imatrix`), and hands both to llama.cpp's
  ``llama_model_quantize`` with the recipe's per-tensor overrides.

Either way the per-tensor plan exists as data before any weight is touched
(:func:`plan_gguf`; for llama.cpp it comes from llama.cpp's own dry run on a sparse
skeleton file), the output appears atomically, and the result is a summary dict the
CLI prints: size, bits per weight, tensor types, fallbacks, tokenizer, imatrix.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from llmctl.errors import UsageError
from llmctl.gguf import llamacpp
from llmctl.gguf.recipe import GGUFRecipe, intermediate_type, load_recipe, parse_recipe
from llmctl.gguf.summary import bits_per_weight, summarize_gguf, type_counts
from llmctl.gguf.tokenizer import GGUFVocab, read_hf_vocab
from llmctl.gguf.types import file_type
from llmctl.gguf.writer import (
    TensorPlan,
    build_plan,
    source_dtype,
    type_nbytes,
    write_gguf,
)
from llmctl.utils.atomic import atomic_path

Progress = Callable[[int, int], None]
RecipeLike = GGUFRecipe | dict[str, Any] | str | Path | None


def resolve_recipe(recipe: RecipeLike = None, gguf_type: str | None = None,
                   imatrix: bool | str | Path | None = None, calibration: str | None = None,
                   threads: int | None = None) -> GGUFRecipe:
    """One validated recipe from a recipe (object, dict or YAML path) and CLI values.

    Command-line values win over the recipe's. ``imatrix``: True or "auto" computes
    one from ``calibration`` (default ``builtin:pydoc-calib``); a path loads a file.
    """
    if isinstance(recipe, (str, Path)):
        base = load_recipe(recipe)
    else:
        base = parse_recipe(recipe)
    data = base.model_dump(exclude_unset=True)
    if gguf_type is not None:
        data["type"] = gguf_type
    if threads is not None:
        data["threads"] = threads
    spec = dict(data.get("imatrix") or {})
    if imatrix not in (None, False):
        if imatrix is True or str(imatrix) == "auto":
            spec.pop("file", None)
        else:
            spec["file"] = str(imatrix)
        data["imatrix"] = spec
    if calibration is not None:
        spec["calibration"] = calibration
        if "imatrix" in data:
            data["imatrix"] = spec
    return parse_recipe(data)


class _Stages:
    """Maps each stage's own (done, total) onto one bar over all stages."""

    def __init__(self, progress: Progress | None, sizes: dict[str, int]) -> None:
        self.progress, self.sizes = progress, sizes
        self.total = sum(sizes.values())

    def stage(self, name: str) -> Progress | None:
        if self.progress is None:
            return None
        offset = 0
        for key, size in self.sizes.items():
            if key == name:
                break
            offset += size
        size = self.sizes[name]

        def update(done: int, total: int) -> None:
            self.progress(offset + round(size * done / max(total, 1)), self.total)

        return update


@contextmanager
def _workdir(near: Path):
    """A temp directory on the output's filesystem (intermediates can be large)."""
    near.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".llmctl-gguf-", dir=near) as tmp:
        yield Path(tmp)


def _rules(recipe: GGUFRecipe) -> dict[str, Any]:
    return {"overrides": [(o.pattern, o.type) for o in recipe.overrides],
            "output_type": recipe.output_type, "token_embd_type": recipe.token_embd_type}


def _llama_plan(model_dir: Path, recipe: GGUFRecipe, vocab: GGUFVocab, work: Path,
                float_plan: list[TensorPlan], with_imatrix: bool
                ) -> tuple[list[TensorPlan], llamacpp.QuantizeLog]:
    """llama.cpp's own per-tensor decisions, from a dry run on a sparse skeleton."""
    skeleton = work / "skeleton.gguf"
    write_gguf(model_dir, skeleton, float_plan, file_type(float_plan_type(float_plan)).ftype,
               vocab=vocab, skeleton=True)
    # With an imatrix llama.cpp picks some types differently (e.g. IQ3_XXS attn_v), so
    # the dry run must know one is coming; its content does not matter here.
    dummy = {"__plan__": [1.0]} if with_imatrix else None
    log = llamacpp.quantize(skeleton, work / "dry-run.gguf", file_type(recipe.type).ftype,
                            imatrix=dummy, pure=recipe.pure, dry_run=True,
                            threads=recipe.threads, **_rules(recipe))
    skeleton.unlink()
    by_name = {p.name: p for p in float_plan}
    notes: dict[str, str] = {}
    for f in log.fallbacks:
        notes[f["tensor"]] = (f"fallback: {f['columns']} columns not divisible by "
                              f"{f['block']} ({f['wanted']}) -> {f['used']}")
    for o in log.overrides:
        notes.setdefault(o["tensor"], f"override {o['from']} -> {o['to']}")
    plan = []
    for t in log.tensors:
        src = by_name[t["name"]]
        kind = t["to"]
        note = notes.get(t["name"], "" if kind != src.type else src.note or "kept")
        plan.append(TensorPlan(src.name, src.source, src.shape, kind,
                               type_nbytes(src.shape, kind), note))
    order = {p.name: i for i, p in enumerate(float_plan)}  # show llmctl's file order
    return sorted(plan, key=lambda p: order[p.name]), log


def float_plan_type(plan: list[TensorPlan]) -> str:
    kinds = {p.type for p in plan if len(p.shape) >= 2}
    return next(iter(kinds)) if len(kinds) == 1 else "F32"


def _plan_dict(model_dir: Path, recipe: GGUFRecipe, engine: str, plan: list[TensorPlan],
               vocab: GGUFVocab, intermediate: str | None, imatrix: dict | None,
               fallbacks: list[dict]) -> dict[str, Any]:
    tensors = [p.to_dict() for p in plan]
    return {
        "source": str(model_dir),
        "format": "gguf",
        "type": recipe.type,
        "ftype": file_type(recipe.type).ftype,
        "engine": engine,
        "llama_cpp": llamacpp.version() if engine == "llama.cpp" else None,
        "intermediate": intermediate,
        "n_parameters": sum(p.n_elements for p in plan),
        "tensor_bytes": sum(p.n_bytes for p in plan),
        "bits_per_weight": bits_per_weight(tensors),
        "types": type_counts(tensors),
        "fallbacks": fallbacks,
        "tokenizer": vocab.describe(),
        "imatrix": imatrix,
        "recipe": recipe.model_dump(),
        "tensors": tensors,
    }


def _imatrix_plan(recipe: GGUFRecipe) -> dict | None:
    if recipe.imatrix is None:
        return None
    spec = recipe.imatrix
    if spec.file:
        return {"file": spec.file}
    return {"calibration": spec.calibration, "samples": spec.samples, "seq_len": spec.seq_len,
            "seed": spec.seed}


def _prepare(model_dir: Path, recipe: GGUFRecipe, work: Path | None):
    engine = recipe.resolved_engine()
    if engine == "llama.cpp":
        llamacpp.require()  # fail before any work, with the install line
        if recipe.imatrix is None and file_type(recipe.type).needs_imatrix:
            raise UsageError(f"{recipe.type} needs an importance matrix",
                             "add --imatrix (computed from --calibration) or an imatrix file")
    if engine == "llmctl":
        ft = file_type(recipe.type)
        config, tensors, plan = build_plan(model_dir, ft.tensor_type,
                                           expert_type=ft.expert_type, **_rules(recipe))
        vocab = read_hf_vocab(model_dir, config)
        return engine, config, vocab, plan, None, None, []
    config, tensors, _ = build_plan(model_dir, "F32")
    inter = intermediate_type(recipe, source_dtype(tensors))
    _, _, float_plan = build_plan(model_dir, inter)
    vocab = read_hf_vocab(model_dir, config)
    plan, log = _llama_plan(model_dir, recipe, vocab, work, float_plan,
                            with_imatrix=recipe.imatrix is not None)
    return engine, config, vocab, plan, float_plan, inter, log.fallbacks


def plan_gguf(model_dir: Path, gguf_type: str | None = None, recipe_overrides: RecipeLike = None,
              imatrix: bool | str | Path | None = None, calibration: str | None = None, *,
              threads: int | None = None) -> dict[str, Any]:
    """The ``--dry-run`` answer: every tensor's type, the size and bpw, fallbacks.

    Reads only headers and the tokenizer; for llama.cpp types it runs llama.cpp's
    quantizer in dry-run mode on a sparse skeleton (no weights read or written).
    """
    model_dir = Path(model_dir)
    recipe = resolve_recipe(recipe_overrides, gguf_type, imatrix, calibration, threads)
    with tempfile.TemporaryDirectory(prefix="llmctl-gguf-plan-") as tmp:
        engine, _, vocab, plan, _, inter, fallbacks = _prepare(model_dir, recipe, Path(tmp))
    return {**_plan_dict(model_dir, recipe, engine, plan, vocab, inter, _imatrix_plan(recipe),
                         fallbacks), "dry_run": True}


def _imatrix_values(model_dir: Path, recipe: GGUFRecipe, progress: Progress | None
                    ) -> tuple[dict | None, dict | None]:
    from llmctl.gguf import imatrix as im

    spec = recipe.imatrix
    if spec is None:
        return None, None
    if spec.file:
        matrix = im.load_imatrix(Path(spec.file))
        return matrix.values(), {"file": spec.file, **matrix.describe()}
    matrix = im.compute_imatrix(model_dir, spec.calibration, samples=spec.samples,
                                seq_len=spec.seq_len, seed=spec.seed, field=spec.field,
                                progress=progress)
    info = {**_imatrix_plan(recipe), **matrix.describe()}
    if spec.save:
        info["saved"] = str(im.save_imatrix(matrix, Path(spec.save)))
    return matrix.values(), info


def quantize_to_gguf(model_dir: Path, out_path: Path | None = None,
                     gguf_type: str | None = None, recipe_overrides: RecipeLike = None,
                     imatrix: bool | str | Path | None = None, calibration: str | None = None,
                     progress: Progress | None = None, *, dry_run: bool = False,
                     threads: int | None = None) -> dict[str, Any]:
    """Convert ``model_dir`` (an HF checkpoint) into ``out_path`` and summarise it.

    ``gguf_type`` (e.g. ``Q4_K_M``) overrides the recipe's ``type``;
    ``recipe_overrides`` is a GGUF recipe (object, dict or YAML path);
    ``imatrix`` is True/"auto" to compute one from ``calibration`` or an imatrix path;
    ``progress(done, total)`` covers every stage. With ``dry_run`` nothing is written
    and the plan is returned (same keys, ``dry_run: True``); ``out_path`` may then be None.
    """
    if dry_run:
        return plan_gguf(model_dir, gguf_type, recipe_overrides, imatrix, calibration,
                         threads=threads)
    if out_path is None:
        raise UsageError("no output file given for the GGUF export", "pass -o model.gguf")
    model_dir, out_path = Path(model_dir), Path(out_path)
    recipe = resolve_recipe(recipe_overrides, gguf_type, imatrix, calibration, threads)
    if out_path.suffix.lower() != ".gguf":
        raise UsageError(f"output {out_path} does not end in .gguf",
                         "name the output file like model-Q4_K_M.gguf")
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with _workdir(out_path.parent) as work:
        engine, _, vocab, plan, float_plan, inter, fallbacks = _prepare(
            model_dir, recipe, work)
        seconds["plan"] = time.perf_counter() - start
        n = len(plan)
        computing = recipe.imatrix is not None and not recipe.imatrix.file
        sizes = {"imatrix": recipe.imatrix.samples if computing else 0,
                 "intermediate": n if engine == "llama.cpp" else 0, "write": n}
        stages = _Stages(progress, sizes)
        ftype = file_type(recipe.type).ftype
        imatrix_info = None
        if engine == "llmctl":
            t = time.perf_counter()
            write_gguf(model_dir, out_path, plan, ftype, vocab=vocab,
                       progress=stages.stage("write"), threads=recipe.threads)
            seconds["write"] = time.perf_counter() - t
            log = None
        else:
            t = time.perf_counter()
            values, imatrix_info = _imatrix_values(model_dir, recipe, stages.stage("imatrix"))
            seconds["imatrix"] = time.perf_counter() - t
            t = time.perf_counter()
            intermediate = work / f"intermediate-{inter}.gguf"
            write_gguf(model_dir, intermediate, float_plan, file_type(inter).ftype, vocab=vocab,
                       progress=stages.stage("intermediate"), threads=recipe.threads)
            seconds["intermediate"] = time.perf_counter() - t
            t = time.perf_counter()
            with atomic_path(out_path) as tmp:
                log = llamacpp.quantize(intermediate, tmp, ftype, imatrix=values,
                                        pure=recipe.pure, threads=recipe.threads,
                                        progress=stages.stage("write"), **_rules(recipe))
            intermediate.unlink()
            seconds["quantize"] = time.perf_counter() - t
            fallbacks = log.fallbacks
    seconds["total"] = time.perf_counter() - start
    written = summarize_gguf(out_path)
    tensors = written["tensors"]
    notes = {p.name: p.note for p in plan}
    for t in tensors:
        t["note"] = notes.get(t["name"], "")
    summary = _plan_dict(model_dir, recipe, engine, plan, vocab, inter,
                         imatrix_info or _imatrix_plan(recipe), fallbacks)
    summary.update(
        path=str(out_path),
        size=written["size"],
        n_parameters=written["n_parameters"],
        tensor_bytes=written["tensor_bytes"],
        bits_per_weight=written["bits_per_weight"],
        types=written["types"],
        tensors=tensors,
        seconds={k: round(v, 2) for k, v in seconds.items()},
        dry_run=False,
    )
    return summary


def summary_lines(summary: dict[str, Any], tensors: bool = True) -> list[str]:
    """Plain-text lines for a plan or summary (the CLI may render its own table)."""
    head = "plan" if summary.get("dry_run") else summary.get("path", "")
    size = summary.get("size", summary["tensor_bytes"])
    lines = [
        f"{head}: {summary['type']} via {summary['engine']}"
        + (f" (from {summary['intermediate']})" if summary.get("intermediate") else ""),
        (f"  {summary['n_parameters']:,} weights, {size / 2**20:.1f} MiB"
         f"{' of tensors' if summary.get('dry_run') else ''}, "
         f"{summary['bits_per_weight']:.2f} bits per weight"),
        "  types: " + ", ".join(f"{k} x{v}" for k, v in summary["types"].items()),
        f"  tokenizer: {summary['tokenizer']['model']} / pre '{summary['tokenizer']['pre']}'",
    ]
    if summary.get("imatrix"):
        lines.append("  imatrix: " + ", ".join(f"{k}={v}" for k, v in summary["imatrix"].items()))
    if summary["fallbacks"]:
        lines.append(f"  fallbacks: {len(summary['fallbacks'])} tensors could not take the "
                     "requested type (rows not a multiple of the block):")
        for f in summary["fallbacks"]:
            lines.append(f"    {f['tensor']}: {f['columns']} columns, {f['wanted']} -> {f['used']}")
    if tensors:
        for t in summary["tensors"]:
            shape = "x".join(str(d) for d in t["shape"])
            lines.append(f"  {t['name']:<34} {shape:>12} {t['type']:>7}  {t.get('note', '')}"
                         .rstrip())
    return lines
