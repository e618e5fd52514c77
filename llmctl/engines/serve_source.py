"""Engine directories as a model source of ``llmctl serve`` (:mod:`llmctl.serve.engine.sources`).

Registered when :mod:`llmctl.engines` is imported, so the serve layer never imports this
package. Claiming a MODEL reads only its manifest; opening it is
:func:`llmctl.engines.serve_engine.open_serving_engine` (manifest checked against this
host, runtime loaded, llmctl's scheduler over it).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from llmctl.serve.engine.sources import OpenedModel, register_model_source

log = logging.getLogger("llmctl.serve")


class EngineDirSource:
    name = "engine-dir"

    def claims(self, model: str) -> bool:
        from llmctl.engines.manifest import is_engine_dir

        return is_engine_dir(model)

    def open(self, model: str, engine_kwargs: dict[str, Any]) -> OpenedModel:
        from llmctl.engines.serve_engine import open_serving_engine

        engine = open_serving_engine(model, **engine_kwargs)
        log.info("%s", engine.target.describe())
        # the directory's name says what was built (e.g. smollm2-onnx-int4); the path as
        # typed is accepted too, as it is for a checkpoint
        name = Path(model).resolve().name
        return OpenedModel(engine, name, (model,) if model != name else ())


register_model_source(EngineDirSource())
