"""``llmctl eval``: perplexity, KL divergence against a reference, task accuracy, gates.

One concept per module, imports flowing one way (left depends on nothing to its right)::

    windows, metrics           pure: which tokens are scored; the statistics
    logprobs                   pure: one window's logits -> per-token rows
    reference_store            the reference's top-k rows on disk, read window by window
    candidates                 adapters: HF / compressed-tensors, GGUF, OpenAI server, engine
    tasks, lm_eval_bridge      multiple-choice tasks; lm-evaluation-harness on our adapters
    paired                     per-item task outcomes of two runs, paired for delta gates
    memory                     keeps RSS flat across windows (glibc mmap threshold)
    runner                     the pipeline; report, compare: JSON/Markdown, side by side

Gates come from ``llmctl.gates`` (their statistics from ``llmctl.stats``); the report
metadata block from ``llmctl.report``.
"""
