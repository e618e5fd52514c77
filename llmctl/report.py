"""The metadata block every llmctl report carries (bench, eval, quantize, build).

Numbers are only comparable with their context: versions, commit, machine and how
busy it was while measuring (these machines are shared and noisy).
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from llmctl import __version__
from llmctl.utils.cpu import cpu_model, ram_bytes


def _git_commit() -> str | None:
    repo = Path(__file__).resolve().parents[1]
    try:
        out = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip() or None
    return f"{commit}-dirty" if commit and dirty else commit


REPORTED_PACKAGES = ("torch", "transformers", "safetensors", "compressed-tensors", "gguf",
                     "numpy")


def package_versions(names: tuple[str, ...]) -> dict[str, str | None]:
    """llmctl's version and each named distribution's (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    found: dict[str, str | None] = {"llmctl": __version__}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = None
    return found


def _versions() -> dict[str, str | None]:
    return {**package_versions(REPORTED_PACKAGES), "python": platform.python_version()}


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "ram_bytes": ram_bytes(),
        "os": platform.platform(),
        "gpu": None,
    }
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        info["load_average"] = None
    import sys

    if "torch" in sys.modules:
        import torch

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
        info["torch_threads"] = torch.get_num_threads()
    return info


def run_metadata(**extra: Any) -> dict[str, Any]:
    """The shared block: date, versions, git commit, machine, plus command-specific keys."""
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "llmctl_commit": _git_commit(),
        "versions": _versions(),
        "machine": machine(),
        **extra,
    }
