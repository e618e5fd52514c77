"""GGUF out: a checkpoint into llama.cpp's file format (writer, block quantizers, recipes,
importance matrices) and llama.cpp itself (quantizer, runtime).

Reading a GGUF in is the model layer's (:mod:`llmctl.models.gguf_reader`,
:mod:`llmctl.models.gguf_import`): every command resolves the embedded GGUF model, so the
reader sits below this package, which loads checkpoints through :mod:`llmctl.models`.
The one exception is the legacy block codecs (:mod:`llmctl.gguf.quants`, numpy only): each
type's encoder and decoder live side by side there, and the engine
(:mod:`llmctl.serve.model.gguf_weights`) imports the decoders to keep quantized tensors quantized.
"""
