"""``llmctl-engine.json``: what an engine directory holds, how it was built, what it needs.

Every engine directory carries one. It records the source model and its hash, the
target and precision, the versions of the runtime and tools, the machine it was built
on, the build time and the command that serves it, plus a size + quick hash of every
file (a truncated copy is caught before a runtime fails obscurely).

``requirements`` is what loading needs from the machine; :func:`check_compatible`
compares it with a probe of the current host and refuses with every reason at once:

- ``arch`` and ``cpu_flags``: native code compiled into the engine (AOTInductor emits
  C++ built with ``-mavx512f`` ... for the build machine's vector ISA), so a CPU without
  those flags would die with SIGILL instead of an error.
- ``execution_provider``: an ONNX graph built for CUDA (fp16, CUDA-only fused ops) does
  not run on the CPU provider.
- ``packages``: a version rule per runtime package: ``exact`` (AOTInductor packages link
  against one libtorch), ``at_least`` (an ONNX graph needs the opset / contrib ops of the
  onnxruntime it was built with).
- ``gpu``: engines that only run on an NVIDIA GPU (TensorRT-LLM).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmctl.engines.host import Host
from llmctl.errors import LlmctlError, NotAModelError
from llmctl.models.manifest import quick_hash
from llmctl.utils.atomic import write_text

MANIFEST_NAME = "llmctl-engine.json"
FORMAT_VERSION = 1

# A requirement on package X is met by any of these installed distributions.
PACKAGE_ALIASES: dict[str, tuple[str, ...]] = {
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu"),
    "tensorrt-llm": ("tensorrt-llm", "tensorrt_llm"),
}


class EngineIncompatibleError(LlmctlError):
    """The engine was built for a machine or runtime this one does not match."""


class NotAnEngineError(NotAModelError):
    pass


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FileEntry(_Strict):
    size: int
    quick_hash: str


class SourceInfo(_Strict):
    reference: str  # what the user typed
    path: str
    model_type: str
    sha256: str  # over config.json and every weight file's sha256 (see source.py)
    quantization: str | None = None  # e.g. "compressed-tensors:pack-quantized W4 g64"


class PackageRule(_Strict):
    version: str
    match: Literal["exact", "at_least"] = "at_least"


class Requirements(_Strict):
    arch: str | None = None
    cpu_flags: list[str] = Field(default_factory=list)
    execution_provider: str | None = None
    gpu: bool = False
    packages: dict[str, PackageRule] = Field(default_factory=dict)


class BuildInfo(_Strict):
    llmctl_version: str
    date: str
    seconds: float
    command: str
    tool: str  # what produced the artifact, e.g. "onnxruntime-genai 0.18.0 model builder"
    options: dict = Field(default_factory=dict)
    machine_load: list[float] | None = None


class EngineManifest(_Strict):
    format_version: int = FORMAT_VERSION
    target: str
    precision: str
    source: SourceInfo
    requirements: Requirements
    built_on: dict
    build: BuildInfo
    serve_command: str
    target_info: dict = Field(default_factory=dict)
    notes: list[str] = Field(default_factory=list)
    files: dict[str, FileEntry] = Field(default_factory=dict)


# --- reading and writing -------------------------------------------------------------------
def engine_files(directory: Path) -> dict[str, FileEntry]:
    """Every file under ``directory`` (recursively) except the manifest itself."""
    out: dict[str, FileEntry] = {}
    for path in sorted(Path(directory).rglob("*")):
        if path.is_file() and path.name != MANIFEST_NAME:
            out[path.relative_to(directory).as_posix()] = FileEntry(
                size=path.stat().st_size, quick_hash=quick_hash(path))
    return out


def write_manifest(directory: Path, manifest: EngineManifest) -> EngineManifest:
    manifest = manifest.model_copy(update={"files": engine_files(directory)})
    write_text(Path(directory) / MANIFEST_NAME, manifest.model_dump_json(indent=2) + "\n")
    return manifest


def is_engine_dir(path: Path) -> bool:
    return (Path(path) / MANIFEST_NAME).is_file()


def read_manifest(directory: Path) -> EngineManifest:
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        raise NotAnEngineError(f"{directory} is not an engine directory (no {MANIFEST_NAME})",
                               "build one with `llmctl build-engine MODEL --target ... -o DIR`")
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise NotAnEngineError(f"{path} is not valid JSON: {exc}",
                               "rebuild the engine") from None
    if data.get("format_version") != FORMAT_VERSION:
        raise EngineIncompatibleError(
            f"{path} has manifest format {data.get('format_version')!r}; this llmctl reads "
            f"format {FORMAT_VERSION}", "rebuild the engine with this llmctl version")
    try:
        return EngineManifest.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors()[:5])
        raise NotAnEngineError(f"{path} does not validate: {problems}",
                               "rebuild the engine; do not edit the manifest by hand") from None


def integrity_problems(directory: Path, manifest: EngineManifest) -> list[str]:
    problems = []
    for name, entry in manifest.files.items():
        path = Path(directory) / name
        if not path.is_file():
            problems.append(f"{name} is missing")
        elif path.stat().st_size != entry.size:
            problems.append(f"{name} has {path.stat().st_size} bytes, expected {entry.size}")
        elif quick_hash(path) != entry.quick_hash:
            problems.append(f"{name} does not match its hash")
    return problems


# --- compatibility -------------------------------------------------------------------------
def _installed(name: str, host: Host) -> str | None:
    for dist in PACKAGE_ALIASES.get(name, (name,)):
        found = host.packages.get(dist)
        if found is None and dist not in host.packages:
            from llmctl.engines.host import package_version

            found = package_version(dist)
        if found is not None:
            return found
    return None


def _version_problem(name: str, rule: PackageRule, installed: str | None) -> str | None:
    from packaging.version import InvalidVersion, Version

    if installed is None:
        return f"it needs the Python package {name} ({rule.version}), which is not installed"
    if rule.match == "exact":
        if installed != rule.version:
            return (f"it was compiled against {name} {rule.version} and this machine has "
                    f"{installed} (compiled packages only load into the same version)")
        return None
    try:
        if Version(installed) < Version(rule.version):
            return f"it needs {name} >= {rule.version}; this machine has {installed}"
    except InvalidVersion:
        return None
    return None


def compatibility_problems(manifest: EngineManifest, host: Host,
                           providers: list[str] | None = None) -> list[str]:
    """Every reason this host cannot load the engine (empty: compatible)."""
    req = manifest.requirements
    problems: list[str] = []
    if req.arch and req.arch != host.arch:
        problems.append(f"it was built for {req.arch} and this machine is {host.arch}")
    missing = sorted(set(req.cpu_flags) - host.flags)
    if missing and (not req.arch or req.arch == host.arch):
        problems.append(f"its compiled code uses CPU instructions this CPU lacks: "
                        f"{', '.join(missing)} (built on: {manifest.built_on.get('cpu', '?')})")
    if req.gpu and not host.gpus:
        problems.append("it runs only on an NVIDIA GPU and none was found (nvidia-smi)")
    if req.execution_provider and req.execution_provider != "CPUExecutionProvider":
        available = providers if providers is not None else _ort_providers()
        if req.execution_provider not in available:
            problems.append(f"it was built for onnxruntime's {req.execution_provider}, which "
                            f"this onnxruntime does not offer (it has: "
                            f"{', '.join(available) or 'none'})")
    for name, rule in req.packages.items():
        problem = _version_problem(name, rule, _installed(name, host))
        if problem:
            problems.append(problem)
    return problems


def _ort_providers() -> list[str]:
    from llmctl.engines.host import ort_providers

    return ort_providers()


def check_compatible(manifest: EngineManifest, host: Host | None = None,
                     providers: list[str] | None = None) -> None:
    """Raise :class:`EngineIncompatibleError` naming every mismatch, or return."""
    problems = compatibility_problems(manifest, host or Host.probe(), providers)
    if problems:
        raise EngineIncompatibleError(
            f"this {manifest.target} engine cannot load here: " + "; ".join(problems),
            f"rebuild it on this machine: {manifest.build.command}")
