"""Resolve what a user types as MODEL into a local Hugging Face checkpoint directory.

Order: an embedded alias, an existing local path (HF directory or ``.gguf`` file,
the latter imported once into the cache), then a hub id (``org/name``).
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ModelNotFoundError, NotAModelError, OfflineError
from llmctl.home import models_dir
from llmctl.models.architectures import get_architecture
from llmctl.models.embedded import EMBEDDED
from llmctl.models.gguf_import import Progress, import_gguf
from llmctl.models.manifest import manifest_problem, quick_hash

log = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_WEIGHT_GLOBS = ("*.safetensors", "*.bin")


@dataclass(frozen=True)
class ResolvedModel:
    reference: str
    path: Path
    source: str  # "embedded" | "gguf" | "local" | "hub"
    origin: Path | None = None  # the GGUF a cached checkpoint came from


def check_hf_dir(path: Path) -> str:
    """Return the model_type of a usable HF directory, or raise with what is wrong."""
    config = path / "config.json"
    if not config.is_file():
        raise NotAModelError(
            f"{path} is not a model directory (no config.json)",
            "pass a Hugging Face checkpoint directory, a .gguf file or 'smollm2-135m'",
        )
    try:
        model_type = json.loads(config.read_text()).get("model_type", "")
    except ValueError as exc:
        raise NotAModelError(f"{config} is not valid JSON: {exc}", "fix or re-create it") from None
    get_architecture(model_type)
    if not any(next(path.glob(g), None) for g in _WEIGHT_GLOBS):
        raise NotAModelError(
            f"{path} has a config.json but no weights (*.safetensors / *.bin)",
            "the download or export is incomplete; fetch or write the weights again",
        )
    return model_type


def is_hub_id(reference: str) -> bool:
    """Whether ``reference`` reads as a Hugging Face Hub id (``org/name``)."""
    return bool(_HUB_ID.match(reference)) and not reference.endswith(".gguf")


def _cached_import(gguf_path: Path, name: str, progress: Progress | None) -> Path:
    dest = models_dir() / f"{name}-{quick_hash(gguf_path)[:12]}"
    problem = manifest_problem(dest) if dest.exists() else "not converted yet"
    if problem is not None:
        if dest.exists():
            log.warning("cached model %s is unusable (%s); converting again", dest, problem)
        import_gguf(gguf_path, dest, progress)
    return dest


def _from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns, etag_timeout=5))
    except LocalEntryNotFoundError:
        raise OfflineError(
            f"cannot download {repo_id!r}: the Hugging Face Hub is not reachable",
            "download it where the hub is reachable and pass the local directory",
        ) from None
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(
            f"the hub refused {repo_id!r}: {exc}".splitlines()[0],
            "check the repository id and, for gated models, HF_TOKEN",
        ) from None


def resolve_model(reference: str, progress: Progress | None = None) -> ResolvedModel:
    if reference in EMBEDDED:
        embedded = EMBEDDED[reference]
        gguf_path = embedded.locate()
        stem = Path(embedded.filename).stem.split(".")[0].lower()
        return ResolvedModel(reference, _cached_import(gguf_path, stem, progress), "embedded",
                             gguf_path)
    path = Path(reference).expanduser()
    if path.is_dir():
        check_hf_dir(path)
        return ResolvedModel(reference, path.resolve(), "local")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise NotAModelError(
                f"{path} is a file but not a .gguf model",
                "pass a checkpoint directory, a .gguf file or 'smollm2-135m'",
            )
        dest = _cached_import(path.resolve(), path.stem.lower(), progress)
        return ResolvedModel(reference, dest, "gguf", path.resolve())
    if is_hub_id(reference):
        return ResolvedModel(reference, _from_hub(reference), "hub")
    raise ModelNotFoundError(
        f"no model at {reference!r}",
        "pass an existing directory, a .gguf file, a hub id (org/name) or one of: "
        + ", ".join(EMBEDDED),
    )


def checkpoint_dtype(reference: str) -> str | None:
    """``torch_dtype`` from a model's config.json (resolving the reference first)."""
    import json

    path = resolve_model(reference).path
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config.get("torch_dtype") or config.get("dtype")


def kv_cache_scheme(path: Path) -> dict | None:
    """The ``quantization_config.kv_cache_scheme`` of the checkpoint at ``path`` (static
    FP8 K/V scales, as llm-compressor and ``llmctl quantize`` write them), or None."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    scheme = (config.get("quantization_config") or {}).get("kv_cache_scheme")
    return scheme if isinstance(scheme, dict) else None
