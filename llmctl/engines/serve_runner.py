"""Let llmctl's serving engine (scheduler, sampler, detokenizer, HTTP API) drive an engine
directory: an object with the ``ModelRunner`` contract of :mod:`llmctl.serve.model.runner`.

``execute(scheduled) -> (logits [rows, vocab], rows)``: for each scheduled sequence the
runner feeds the tokens from its ``num_computed_tokens`` on (a prompt chunk, the last
sampled token, plus draft tokens) to the engine's runtime, which keeps each sequence's
cache in a per-sequence state instead of the paged KV pool. The pool's block accounting
still bounds how many sequences run at once; its blocks are simply not read.

Wiring (done by :class:`llmctl.engines.serve_engine.EngineDirTarget`, which
``llmctl serve ENGINE_DIR`` uses): an ``LLMEngine`` whose target is the engine directory's
``config.json``, ``generation_config.json`` and tokenizer (no torch weights are loaded,
the KV pool is planned for accounting but never allocated) with its ``runner`` set
to ``open_engine(path).runner()``, and these settings:

- ``enable_prefix_caching=False`` (forced, with a warning if asked for): cached prefix
  blocks would claim KV this runner never computed (refused with an error if it happens);
- speculative decoding with ``ngram`` works (drafts are verified as a chunk of
  ``1 + k`` tokens and rejected ones are dropped by truncating the state); a draft
  *model* needs the paged runner and is refused;
- prompt log-probs (``echo`` with ``logprobs`` on /v1/completions, which is what
  ``llmctl eval openai:URL`` and lm-eval send): :meth:`EngineRunner.execute_with_prompt`
  asks the runtime for every position's logits of a prompt chunk;
- ``n > 1``: a forked sequence starts from a copy of its sibling's cache (re-running the
  shared prefix);
- continuous batching: sequences join and leave the decode batch at every step; a
  prompt chunk (or a speculative verify chunk) runs in its own runtime call, one
  sequence at a time, so that is where a step serialises (see
  :mod:`llmctl.engines.runtime`).
"""

from __future__ import annotations

import numpy as np

from llmctl.engines.runtime import SeqState
from llmctl.errors import ConfigError


class EngineRunner:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.runtime = engine.runtime
        self._states: dict[int, tuple[object, SeqState]] = {}  # seq_id -> (seq, state)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Paged-cache copy-on-write has nothing to copy here (states are private)."""

    def _state_for(self, seq) -> SeqState:
        c = seq.num_computed_tokens
        entry = self._states.get(seq.seq_id)
        state = entry[1] if entry else None
        if state is not None and c == 0 and state.length > 0:
            state = None  # preempted and recomputed from scratch
        if state is None:
            state = self.runtime.new_state()
            if c > 0:
                state = self._fork(seq, c)
            self._states[seq.seq_id] = (seq, state)
        state.length = min(state.length, c)  # rejected draft tokens: drop their entries
        return state

    def _fork(self, seq, c: int) -> SeqState:
        for sibling, other in self._states.values():
            if sibling.request is seq.request and \
                    other.length >= c and sibling.token_ids[:c] == seq.token_ids[:c]:
                clone = self.runtime.new_state()
                # re-running the shared prefix is exact and backend-neutral; forks are rare
                self.runtime.forward([clone], [list(seq.token_ids[:c])])
                return clone
        raise ConfigError(
            "a sequence arrived with cached tokens this engine directory never computed",
            "serve engine directories with prefix caching disabled")

    def _collect(self) -> None:
        # Sequence objects have no weakref slot: drop finished ones at each step instead
        for seq_id in [k for k, (seq, _) in self._states.items() if seq.finished]:
            del self._states[seq_id]

    def execute(self, scheduled):
        logits, rows, _ = self.execute_with_prompt(scheduled, with_prompt=False)
        return logits, rows

    def execute_with_prompt(self, scheduled, with_prompt: bool = True):
        """:meth:`execute` plus, for requests that want prompt log-probs, the rows of the
        prompt positions in this chunk (``PromptLogits``, as the paged runner returns)."""
        import torch

        from llmctl.serve.model.runner import LogitRows, PromptLogits

        self._collect()
        states, chunks, wants, items, prompt_spans = [], [], [], [], []
        for item in scheduled:
            seq = item.seq
            c, n, k = seq.num_computed_tokens, item.num_new_tokens, item.num_spec_tokens
            chunk = list(seq.token_ids[c:c + n - k]) + list(seq.spec_token_ids[:k] if k else [])
            states.append(self._state_for(seq))
            chunks.append(chunk)
            wants.append(c + n - k == seq.num_tokens)
            items.append(item)
            # positions c .. end - 1 score prompt tokens c + 1 .. end; the prompt's last
            # position scores the first output token (a sampling row, not a prompt row)
            end = min(c + n - k, seq.num_prompt_tokens - 1)
            needs = with_prompt and seq.request.needs_prompt_logits and end > c
            prompt_spans.append((c + 1, end - c) if needs else None)
        all_logits = any(i.num_spec_tokens for i in items) or any(prompt_spans)
        results = self.runtime.forward(states, chunks, all_logits=all_logits) if items else []
        rows, picked, prompt = [], [], []
        for item, want, result, span in zip(items, wants, results, prompt_spans):
            block = result if result.ndim == 2 else result[None]
            if span is not None:
                first, count = span
                prompt.append(PromptLogits(item, first, torch.from_numpy(
                    np.ascontiguousarray(block[:count], dtype=np.float32))))
            if not want:
                continue
            count = 1 + item.num_spec_tokens
            rows.append(LogitRows(item, len(picked), count))
            picked.extend(block[-count:])
        if not picked:
            return torch.empty((0, self.runtime.vocab_size)), rows, prompt
        return torch.from_numpy(np.stack(picked).astype(np.float32)), rows, prompt
