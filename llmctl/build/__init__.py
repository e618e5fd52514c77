"""``llmctl build-engine``: turn a checkpoint into an artifact for a runtime.

Targets (:mod:`llmctl.build.targets`): ``onnx`` (ONNX Runtime), ``torch-compile``
(an AOTInductor package) and ``tensorrt-llm`` (checkpoint + LLM-API YAML + commands).
Every engine directory has a manifest (:mod:`llmctl.build.manifest`); open one with
:func:`llmctl.build.engine_dir.open_engine`. ``llmctl serve ENGINE_DIR`` runs one under
llmctl's scheduler (:mod:`llmctl.build.serve_engine`); ``llmctl eval ENGINE_DIR`` scores it
(``EngineCandidate`` in :mod:`llmctl.eval.candidates`).
"""
