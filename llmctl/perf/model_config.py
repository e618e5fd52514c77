"""A model's ``config.json`` from whatever the user typed as MODEL, without its weights.

Order (as :func:`llmctl.models.resolve.resolve_model`): an embedded alias (its GGUF's
metadata, read in place: nothing is converted), a local directory (its ``config.json``;
weights need not be there), a ``config.json`` file, a ``.gguf`` file, then a hub id,
whose ``config.json`` alone is fetched (from the local cache first; an unreachable hub
fails within seconds with what to do instead).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from llmctl.errors import ModelNotFoundError, NotAModelError, OfflineError
from llmctl.models.embedded import EMBEDDED
from llmctl.models.resolve import is_hub_id


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise NotAModelError(f"{path} is not valid JSON: {exc}", "fix or re-create it") from None
    if not isinstance(data, dict):
        raise NotAModelError(f"{path} does not hold a JSON object", "pass a model's config.json")
    return data


def _gguf_config(path: Path) -> dict[str, Any]:
    from llmctl.models.gguf_reader import open_checkpoint

    return open_checkpoint(path).config


def _offline(repo_id: str) -> OfflineError:
    return OfflineError(
        f"cannot fetch the config of {repo_id!r}: the Hugging Face Hub is not reachable",
        "download its config.json where the hub is reachable and pass the file or its "
        "directory")


def _hub_reachable(endpoint: str, timeout: float = 3.0) -> bool:
    """One TCP connection to the hub, so an offline machine fails at once instead of
    going through huggingface_hub's retries (five, with back-off: ~25 s)."""
    import socket
    from urllib.parse import urlsplit

    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except OSError:
        return False


def _hub_config(repo_id: str) -> Path:
    from huggingface_hub import constants, hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
    )

    try:
        return Path(hf_hub_download(repo_id, "config.json", local_files_only=True))
    except (LocalEntryNotFoundError, FileNotFoundError):
        pass
    if constants.HF_HUB_OFFLINE or not _hub_reachable(constants.ENDPOINT):
        raise _offline(repo_id)
    try:
        return Path(hf_hub_download(repo_id, "config.json", etag_timeout=5))
    except LocalEntryNotFoundError:  # a subclass of EntryNotFoundError: test it first
        raise _offline(repo_id) from None
    except EntryNotFoundError:
        raise ModelNotFoundError(f"{repo_id!r} on the hub has no config.json",
                                 "pass a transformers model repository") from None
    except HfHubHTTPError as exc:
        raise ModelNotFoundError(f"the hub refused {repo_id!r}: {exc}".splitlines()[0],
                                 "check the repository id and, for gated models, HF_TOKEN"
                                 ) from None


def load_model_config(reference: str) -> tuple[dict[str, Any], str]:
    """``(config, source)``: the config dict and where it was read."""
    if reference in EMBEDDED:
        path = EMBEDDED[reference].locate()
        return _gguf_config(path), f"embedded {reference} (GGUF metadata of {path.name})"
    path = Path(reference).expanduser()
    if path.is_dir():
        config = path / "config.json"
        if not config.is_file():
            raise NotAModelError(f"{path} has no config.json",
                                 "pass a checkpoint directory, a config.json, a .gguf file, "
                                 "a hub id or one of: " + ", ".join(EMBEDDED))
        return _read_json(config), str(config)
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return _gguf_config(path), f"{path} (GGUF metadata)"
        if path.suffix.lower() == ".json":
            return _read_json(path), str(path)
        raise NotAModelError(f"{path} is neither a config.json nor a .gguf file",
                             "pass a checkpoint directory, its config.json or a .gguf file")
    if is_hub_id(reference):
        config = _hub_config(reference)
        return _read_json(config), f"hub {reference} ({config})"
    raise ModelNotFoundError(f"no model at {reference!r}",
                             "pass a directory with a config.json, a .gguf file, a hub id "
                             "(org/name) or one of: " + ", ".join(EMBEDDED))
