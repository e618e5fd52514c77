"""``llmctl build-engine``: turn a checkpoint into an artifact for a runtime.

Targets (:mod:`llmctl.engines.targets`): ``onnx`` (ONNX Runtime), ``torch-compile``
(an AOTInductor package) and ``tensorrt-llm`` (checkpoint + LLM-API YAML + commands).
Every engine directory has a manifest (:mod:`llmctl.engines.manifest`); open one with
:func:`llmctl.engines.engine_dir.open_engine`. ``llmctl serve ENGINE_DIR`` runs one under
llmctl's scheduler (:mod:`llmctl.engines.serve_engine`); ``llmctl eval ENGINE_DIR`` scores it
(``EngineCandidate`` in :mod:`llmctl.eval.engine_candidates`).

Importing this package registers engine directories as a model source of
:mod:`llmctl.serve.engine.sources` (:mod:`llmctl.engines.serve_source`): the serve layer sits
below this package and never imports it.
"""

from llmctl.engines import serve_source  # noqa: F401  (registers with llmctl.serve)
