"""The registry of build targets: name -> the class that builds (and opens) that kind.

Entries are import paths, so listing the targets or parsing the command line never
imports torch, onnx or tensorrt_llm; a target's module is imported when it is used.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

from llmctl.errors import UsageError

if TYPE_CHECKING:
    from llmctl.engines.manifest import EngineManifest, Requirements
    from llmctl.engines.options import CommonOptions
    from llmctl.engines.source import Source

TARGETS: dict[str, str] = {
    "onnx": "llmctl.engines.onnx_target:OnnxTarget",
    "torch-compile": "llmctl.engines.torch_compile_target:TorchCompileTarget",
    "tensorrt-llm": "llmctl.engines.trtllm_target:TensorRTLLMTarget",
}


class NoOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass
class BuildContext:
    source: Source
    out: Path  # the engine directory being filled (a temp dir until the build succeeds)
    workdir: Path  # scratch space, deleted after the build
    common: CommonOptions
    options: Any  # the target's Options instance
    log: Callable[[str], None] = print


@dataclass
class TargetResult:
    requirements: Requirements
    tool: str
    target_info: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    serve_command: str | None = None  # None: "llmctl serve ENGINE_DIR"


class Target(abc.ABC):
    name: ClassVar[str]
    precisions: ClassVar[tuple[str, ...]]  # the first is the default
    Options: ClassVar[type[BaseModel]] = NoOptions
    # Whether llmctl itself can run the result (serve / eval / bench).
    runnable: ClassVar[bool] = True

    @property
    def default_precision(self) -> str:
        return self.precisions[0]

    def check_request(self, common: CommonOptions, options: Any) -> None:
        """Refuse impossible combinations before any work is done."""
        if common.precision not in self.precisions:
            raise UsageError(f"target {self.name!r} does not build precision "
                             f"{common.precision!r}",
                             f"use one of: {', '.join(self.precisions)}")

    def check_source(self, source: Source) -> None:
        """Refuse a checkpoint this target cannot build, before any work is done: by
        default a model type outside the families llmctl runs (the error names them)."""
        from llmctl.models.architectures import get_architecture

        get_architecture(source.model_type, refuse_moe=f"the {self.name} target")

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> TargetResult: ...

    def open(self, path: Path, manifest: EngineManifest, **runtime_options: Any):
        """A :class:`llmctl.engines.runtime.Runtime` over a built engine directory."""
        raise UsageError(f"llmctl cannot run {self.name} engines itself",
                         "use the runtime's own server; see the manifest's serve_command")


def get_target(name: str) -> Target:
    try:
        module, _, cls = TARGETS[name].partition(":")
    except KeyError:
        raise UsageError(f"unknown target {name!r}",
                         f"use one of: {', '.join(TARGETS)}") from None
    return getattr(importlib.import_module(module), cls)()
