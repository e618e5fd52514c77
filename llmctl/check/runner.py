"""Run a pipeline: for every candidate, quantize -> build -> serve -> bench -> eval,
reusing what the same inputs already made.

Each step calls the library the single command uses (``llmctl.quant.run.quantize``,
``llmctl.engines.builder.build_engine``, ``llmctl.bench.suite.run_suite`` against a
``LaunchedServer``, ``llmctl.eval.runner.run_eval``); nothing is measured a second way.

Caching (see ``lineage``): a quantized checkpoint lives in
``$LLMCTL_HOME/check/artifacts/quantize-ID``, an engine in ``.../artifacts/engine-ID``
and an eval result in ``$LLMCTL_HOME/check/measurements/eval-ID.json``, ID the hash of
everything that made it. All are written atomically (a temporary name, renamed when
complete), so a run killed mid-step leaves nothing a later run would take for finished,
and the next run resumes at the first step whose result is missing. Speed is measured
again on every run (the machine, not the artifact, decides it); eval's reference store
is its own artifact, named by the hash of the reference's weights, the text and the
windowing, and rebuilt only with ``--force reference``. ``force`` names steps to redo.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmctl.check.lineage import FileHashes, artifact_id, short, versions
from llmctl.check.pipeline import Candidate, Pipeline, Workload
from llmctl.errors import LlmctlError, StepFailedError, UsageError
from llmctl.home import llmctl_home
from llmctl.utils.atomic import write_text

FORCEABLE = ("quantize", "build", "eval", "reference")


@dataclass
class StepRecord:
    step: str
    status: str  # "ran" | "reused"
    seconds: float
    artifact: str | None = None  # the artifact or measurement ID
    detail: str | None = None

    def to_dict(self) -> dict:
        return {"step": self.step, "status": self.status, "seconds": round(self.seconds, 2),
                "artifact": self.artifact, "detail": self.detail}


@dataclass
class CandidateRun:
    name: str
    recipe: str | None
    path: str  # what was served and evaluated: a checkpoint directory or an endpoint
    artifact_id: str | None = None
    lineage: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    reference_metrics: dict[str, Any] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    rounds: dict[str, list[float]] = field(default_factory=dict)  # bench.W.M -> per round
    eval_report: dict[str, Any] | None = None
    tokenizer: str | None = None  # where the tokenizer is, when `path` has none (an engine)
    reports: dict[str, str] = field(default_factory=dict)  # what -> file in the output dir


class _Ui:
    """The subset of the CLI's output sink the libraries call (status, warn, progress)."""

    def __init__(self, out) -> None:
        self.out = out

    def status(self, message: str) -> None:
        if self.out is not None:
            self.out.status(message)

    def warn(self, message: str) -> None:
        if self.out is not None:
            self.out.warn(message)

    @contextlib.contextmanager
    def progress(self, description: str):
        if self.out is None:
            yield lambda done, total: None
        else:
            with self.out.progress(description) as update:
                yield update


def check_home() -> Path:
    path = llmctl_home() / "check"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _step(name: str, candidate: str, log: Path | None = None):
    """Any failure inside a step becomes StepFailedError naming it (exit 3); usage errors
    (a recipe that does not parse, a gate on an unknown metric) stay usage errors."""
    try:
        yield
    except (UsageError, StepFailedError, KeyboardInterrupt):
        raise
    except Exception as exc:  # every other failure is this step's
        message = exc.message if isinstance(exc, LlmctlError) else f"{type(exc).__name__}: {exc}"
        tail = ""
        if log is not None and log.is_file():
            lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
            tail = " | ".join(lines[-5:])
        raise StepFailedError(f"step {name} failed for candidate {candidate}: {message}",
                              f"last lines of {log}: {tail}" if tail else
                              "rerun with LLMCTL_DEBUG=1 for a traceback") from exc


class CheckRunner:
    def __init__(self, pipeline: Pipeline, out_dir: Path, *, force: set[str] | None = None,
                 out=None) -> None:
        unknown = set(force or ()) - set(FORCEABLE)
        if unknown:
            raise UsageError(f"--force {', '.join(sorted(unknown))}: not a step that caches",
                             f"use one of: {', '.join(FORCEABLE)} (bench always runs)")
        self.pipeline = pipeline
        self.out_dir = Path(out_dir)
        self.force = set(force or ())
        self.ui = _Ui(out)
        self.home = check_home()
        self.hashes = FileHashes(self.home / "file-hashes.json")
        self.versions = versions()
        self._model_path: Path | None = None
        self._model_hash: str | None = None
        self._calibration: dict | None = None

    def validate(self) -> None:
        """Configuration errors before any work (exit 2): every recipe must load and the
        build's precision and target options must be ones its target takes."""
        from llmctl.check.pipeline import PipelineError
        from llmctl.quant.recipe import load_recipe

        if self.pipeline.build is not None:
            from llmctl.engines.options import CommonOptions, validate_options
            from llmctl.engines.targets import get_target

            spec = self.pipeline.build
            try:
                kind = get_target(spec.target)
                kind.check_request(
                    CommonOptions(precision=spec.precision or kind.default_precision,
                                  device=spec.device, max_batch_size=spec.max_batch_size,
                                  max_seq_len=spec.max_seq_len),
                    validate_options(kind.Options, spec.option_strings(), spec.target))
            except LlmctlError as exc:
                raise PipelineError(f"build: {exc.message}", exc.remedy or "fix build:") from None
            if not kind.runnable and (self.pipeline.bench or self.pipeline.eval):
                raise PipelineError(f"build: llmctl cannot serve or evaluate {spec.target} "
                                    "engines itself",
                                    "drop bench/eval, or build an onnx or torch-compile engine")

        for cand in self.candidates():
            if cand is None:
                continue
            try:
                load_recipe(cand.recipe)
            except UsageError:
                raise
            except LlmctlError as exc:
                raise PipelineError(f"candidate {cand.name}: {exc.message}",
                                    exc.remedy or "fix the recipe") from None

    # --- inputs ------------------------------------------------------------------------
    def model_path(self) -> Path:
        if self._model_path is None:
            from llmctl.models.resolve import resolve_model

            with _step("resolve", "model"):
                self._model_path = resolve_model(self.pipeline.model).path
        return self._model_path

    def model_hash(self) -> str:
        if self._model_hash is None:
            self._model_hash = self.hashes.directory(self.model_path())
            self.hashes.save()
        return self._model_hash

    def calibration(self) -> dict:
        """The calibration spec and the SHA-256 of the token ids it draws (shared by every
        candidate: the ids depend on the text, the tokenizer and the spec only)."""
        if self._calibration is None:
            import hashlib

            import numpy as np

            from llmctl.models.loading import load_tokenizer
            from llmctl.quant.calibration import DEFAULT_SOURCE, CalibrationSpec, build_calibration

            q = self.pipeline.quantize
            spec = CalibrationSpec(q.calibration or DEFAULT_SOURCE, "text", q.samples,
                                   q.seq_len, q.seed)
            calib = build_calibration(load_tokenizer(self.model_path()), spec)
            ids = np.ascontiguousarray(calib.ids.numpy().astype(np.int64))
            self._calibration = {"spec": spec, "source_sha256": calib.source_sha256,
                                 "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest()}
        return self._calibration

    # --- steps -------------------------------------------------------------------------
    def quantize(self, cand: Candidate, run: CandidateRun) -> None:
        from llmctl.quant.recipe import load_recipe
        from llmctl.utils.device import resolve_calib_dtype

        q = self.pipeline.quantize
        calib_dtype = resolve_calib_dtype(q.calib_dtype).dtype  # "auto" differs by machine
        with _step("quantize", cand.name):
            recipe = load_recipe(cand.recipe)
            calib = self.calibration()
            lineage = {"kind": "quantize", "model": {"reference": self.pipeline.model,
                                                     "sha256": self.model_hash()},
                       "recipe": {"reference": cand.recipe, "text": recipe.source},
                       "calibration": {"source": calib["spec"].source,
                                       "source_sha256": calib["source_sha256"],
                                       "samples": q.samples, "seq_len": q.seq_len,
                                       "seed": q.seed, "ids_sha256": calib["ids_sha256"]},
                       "calib_dtype": calib_dtype, "versions": self.versions}
        artifact = artifact_id(lineage)
        path = self.home / "artifacts" / f"quantize-{artifact}"
        run.path, run.artifact_id, run.lineage = str(path), artifact, lineage
        from llmctl.quant.run import REPORT_FILE

        if (path / REPORT_FILE).is_file() and "quantize" not in self.force:
            run.steps.append(StepRecord("quantize", "reused", 0.0, artifact,
                                        f"{cand.recipe} -> {path}"))
            self.ui.status(f"[{cand.name}] quantize: reusing {path.name} (same inputs)")
            return
        from llmctl.models.loading import torch_dtype
        from llmctl.quant.pipeline import PipelineOptions
        from llmctl.quant.run import QuantizeRequest
        from llmctl.quant.run import quantize as run_quantize

        self.ui.status(f"[{cand.name}] quantize {cand.recipe} -> {path.name}")
        start = time.perf_counter()
        with _step("quantize", cand.name), self.ui.progress(f"{cand.name}: quantizing") as update:
            request = QuantizeRequest(str(self.model_path()), cand.recipe, path,
                                      calib["spec"], PipelineOptions(
                                          compute_dtype=torch_dtype(calib_dtype)),
                                      overwrite=True)
            run_quantize(request, progress=update, warn=self.ui.warn, status=self.ui.status)
            write_text(path.parent / f"{path.name}.lineage.json",
                       json.dumps(lineage, indent=2, default=str))
        run.steps.append(StepRecord("quantize", "ran", time.perf_counter() - start, artifact,
                                    f"{cand.recipe} -> {path}"))

    def unquantized(self, run: CandidateRun) -> None:
        """No quantize step: the model itself (or the endpoint) is the candidate."""
        endpoint = self.pipeline.serve.endpoint
        if endpoint:
            run.path, run.lineage = endpoint, {"kind": "endpoint", "endpoint": endpoint}
            return
        run.path = str(self.model_path())
        run.artifact_id = short(self.model_hash())
        run.lineage = {"kind": "model", "model": {"reference": self.pipeline.model,
                                                  "sha256": self.model_hash()}}

    def build(self, run: CandidateRun) -> None:
        """The candidate compiled into an engine directory; serve and eval then use it."""
        spec = self.pipeline.build
        if spec is None:
            return
        from llmctl.check.lineage import ENGINE_VERSIONED
        from llmctl.engines.host import Host

        host = Host.probe()
        lineage = {"kind": "engine", "candidate": run.lineage, "target": spec.target,
                   "precision": spec.precision, "device": spec.device,
                   "max_batch_size": spec.max_batch_size, "max_seq_len": spec.max_seq_len,
                   "options": spec.option_strings(),
                   # an engine may be compiled for this ISA (AOTInductor): another CPU
                   # kind names another engine
                   "host": {"arch": host.arch, "isa_flags": host.describe()["isa_flags"],
                            "gpus": list(host.gpus)},
                   "versions": versions(ENGINE_VERSIONED.get(spec.target, ()))}
        artifact = artifact_id(lineage)
        path = self.home / "artifacts" / f"engine-{artifact}"
        source = run.path
        run.path, run.artifact_id, run.lineage = str(path), artifact, lineage
        run.tokenizer = source  # the checkpoint the engine was built from
        from llmctl.engines.manifest import MANIFEST_NAME

        if (path / MANIFEST_NAME).is_file() and "build" not in self.force:
            run.steps.append(StepRecord("build", "reused", 0.0, artifact,
                                        f"{spec.target} -> {path}"))
            self.ui.status(f"[{run.name}] build: reusing {path.name} (same inputs)")
        else:
            from llmctl.engines.builder import build_engine
            from llmctl.engines.options import CommonOptions

            self.ui.status(f"[{run.name}] build {spec.target} engine -> {path.name}")
            start = time.perf_counter()
            with _step("build", run.name), \
                    self.ui.progress(f"{run.name}: building") as update:
                build_engine(source, spec.target, path, common=CommonOptions(
                    precision=spec.precision, device=spec.device,
                    max_batch_size=spec.max_batch_size, max_seq_len=spec.max_seq_len),
                    options=spec.option_strings(), overwrite=True, log=self.ui.status,
                    progress=update)
                write_text(path.parent / f"{path.name}.lineage.json",
                           json.dumps(lineage, indent=2, default=str))
            run.steps.append(StepRecord("build", "ran", time.perf_counter() - start, artifact,
                                        f"{spec.target} -> {path}"))
        from llmctl.engines.manifest import read_manifest

        run.metrics["size.engine_bytes"] = sum(
            f.size for f in read_manifest(path).files.values())

    def bench(self, run: CandidateRun) -> None:
        if not self.pipeline.bench:
            return
        from llmctl.bench.launcher import LaunchedServer, free_port, server_command

        serve = self.pipeline.serve
        log = self.out_dir / "logs" / f"serve-{run.name}.log"
        with contextlib.ExitStack() as stack:
            if serve.endpoint:
                base_url, command = serve.endpoint.rstrip("/"), None
            else:
                port = free_port()
                base_url = f"http://127.0.0.1:{port}"
                # an engine's precision was fixed when it was built
                dtype = f"--dtype {serve.dtype} " if self.pipeline.build is None else ""
                args = dtype + (serve.args or "")
                command = server_command(run.path, port, None, args)
                self.ui.status(f"[{run.name}] starting the server (log: {log})")
                start = time.perf_counter()
                with _step("serve", run.name, log):
                    stack.enter_context(LaunchedServer(command, base_url,
                                                       timeout=serve.timeout, log_path=log))
                run.steps.append(StepRecord("serve", "ran", time.perf_counter() - start,
                                            run.artifact_id, f"log {log}"))
                run.reports["server_log"] = str(log.relative_to(self.out_dir))
            for workload in self.pipeline.bench:
                self._workload(run, workload, base_url, log if command else None)

    def _workload(self, run: CandidateRun, workload: Workload, base_url: str,
                  log: Path | None) -> None:
        from llmctl.bench.config import BenchOptions
        from llmctl.bench.datasets import DatasetSpec
        from llmctl.bench.suite import run_suite

        tokenizer_of = self.pipeline.model if self.pipeline.serve.endpoint else run.path
        opts = BenchOptions(
            target=base_url, model=tokenizer_of, tokenizer=run.tokenizer,
            dataset=DatasetSpec(name=workload.dataset, num_prompts=workload.num_prompts,
                                input_len=workload.input_len, output_len=workload.output_len,
                                seed=workload.seed),
            request_rate=workload.request_rate, max_concurrency=workload.max_concurrency,
            ignore_eos=workload.ignore_eos, repeat=workload.repeat, slos=workload.slos,
            label=workload.name, request_timeout=workload.request_timeout,
            result_dir=str(self.out_dir / "bench" / run.name),
            result_filename=f"{workload.name}.json", plots=True)
        start = time.perf_counter()
        with _step(f"bench {workload.name}", run.name, log):
            suite = run_suite(opts, self.ui, command=f"llmctl check (workload {workload.name})")
        if suite.interrupted:
            raise KeyboardInterrupt
        if suite.target_down or not suite.levels:
            raise StepFailedError(f"step bench {workload.name} failed for candidate "
                                  f"{run.name}: {suite.target_down or 'no result'}",
                                  f"see {log}" if log else "check the endpoint")
        level = suite.levels[0]
        report = level.report
        rounds = (report.get("repeat") or {}).get("runs") or [report]
        for key, value in report.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                name = f"bench.{workload.name}.{key}"
                run.metrics[name] = value
                values = [r.get(key) for r in rounds]
                if all(isinstance(v, (int, float)) for v in values):
                    run.rounds[name] = [float(v) for v in values]
        run.reports[f"bench.{workload.name}"] = str(level.path.relative_to(self.out_dir))
        run.steps.append(StepRecord(f"bench {workload.name}", "ran",
                                    time.perf_counter() - start, run.artifact_id,
                                    f"{len(rounds)} round(s)"))

    def evaluate(self, run: CandidateRun) -> None:
        ev = self.pipeline.eval
        if ev is None:
            return
        from llmctl.eval.report import write_report
        from llmctl.eval.runner import EvalConfig, run_eval
        from llmctl.eval.windows import Windowing

        reference = ev.reference or self.pipeline.model
        config = EvalConfig(candidate=run.path, reference=reference, data=ev.data,
                            windowing=Windowing(ctx=ev.ctx, max_windows=ev.max_windows),
                            top_k=ev.top_k, tasks=ev.tasks, task_limit=ev.task_limit,
                            dtype=ev.dtype, threads=ev.threads,
                            tokenizer=self.pipeline.model if self.pipeline.serve.endpoint
                            else None,
                            cache_dir=self.home / "eval-cache",
                            rebuild_reference="reference" in self.force)
        measured = run.artifact_id is not None  # an endpoint has no content hash
        lineage = {"kind": "eval", "candidate": run.artifact_id,
                   "against": {"reference": reference,
                               "sha256": self.model_hash() if reference == self.pipeline.model
                               else reference},
                   "config": config.model_dump(mode="json", exclude={"candidate", "cache_dir",
                                                                     "rebuild_reference"}),
                   # a local text file is named by its content (builtin: and hf: by name)
                   "data_sha256": self.hashes.file(Path(ev.data))
                   if ev.data and Path(ev.data).is_file() else None,
                   "versions": self.versions}
        mid = artifact_id(lineage)
        cached = self.home / "measurements" / f"eval-{mid}.json"
        start = time.perf_counter()
        redo = bool(self.force & {"eval", "reference"})
        if measured and cached.is_file() and not redo:
            report = json.loads(cached.read_text())
            status = "reused"
            self.ui.status(f"[{run.name}] eval: reusing measurement {mid} (same inputs)")
        else:
            self.ui.status(f"[{run.name}] eval against {reference}")
            with _step("eval", run.name):
                report = run_eval(config, self.ui)
            if measured:
                write_text(cached, json.dumps(report, default=str))
            status = "ran"
        path = self.out_dir / "eval" / f"{run.name}.json"
        write_report(report, path)
        run.eval_report = report
        run.metrics.update(report["metrics"])
        run.reference_metrics.update(report.get("reference_metrics") or {})
        run.counts.update(report.get("counts") or {})
        run.reports["eval"] = str(path.relative_to(self.out_dir))
        reference_info = (report.get("metadata") or {}).get("reference") or {}
        store = reference_info.get("store")
        if store:
            # the reference store is an artifact of its own (named by the reference's
            # weights, the text and the windowing): say whether this eval scored it
            reused = status == "reused" or reference_info.get("store_reused", False)
            run.steps.append(StepRecord("eval reference", "reused" if reused else "ran",
                                        float(report.get("timings_s", {}).get("reference_s", 0))
                                        if not reused else 0.0,
                                        Path(store).stem.rsplit("-", 1)[-1], store))
        run.steps.append(StepRecord("eval", status, time.perf_counter() - start, mid,
                                    f"reference store {store}" if store else None))

    # --- the whole run -----------------------------------------------------------------
    def candidates(self) -> list[Candidate | None]:
        q = self.pipeline.quantize
        return q.candidates() if q is not None else [None]

    def run(self) -> list[CandidateRun]:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        runs = []
        for cand in self.candidates():
            run = CandidateRun(cand.name if cand else "model", cand.recipe if cand else None, "")
            if cand is None:
                self.unquantized(run)
            else:
                self.quantize(cand, run)
            if run.artifact_id is not None and Path(run.path).is_dir():
                run.metrics["size.checkpoint_bytes"] = sum(
                    p.stat().st_size for p in Path(run.path).rglob("*.safetensors"))
            self.build(run)
            self.bench(run)
            self.evaluate(run)
            runs.append(run)
        return runs
