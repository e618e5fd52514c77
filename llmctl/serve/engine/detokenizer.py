"""Incremental detokenization with stop strings that never leak into the output.

Decoding token by token is not concatenating per-token strings: byte-level BPE splits
multi-byte characters over tokens and SentencePiece drops a word's leading space at
the start of a decode. As in vLLM/TGI, each step decodes a short window twice,
``ids[prefix:read]`` and ``ids[prefix:]``, and the new text is the difference; while the
window ends inside a character (U+FFFD) nothing is emitted. The window starts a few
prompt tokens back so the first output token's spacing is right.

Stop strings: the full text is searched (from just before the new text, so a stop
string spanning two tokens is found) and cut before the match. Streaming must not show
text that may turn out to be the start of a stop string, so :meth:`delta` holds back the
longest tail of the text that is a prefix of some stop string until it is resolved.
"""

from __future__ import annotations

from llmctl.serve.core.sampling_params import SamplingParams

_PROMPT_CONTEXT = 5


def fast_decode(tokenizer):
    """``decode(ids, skip_special_tokens=...)``: the Rust tokenizer's own when nothing in
    the transformers wrapper changes the text (it costs ~10x the decode itself)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False) or \
            not hasattr(backend, "decode"):
        return tokenizer.decode
    return backend.decode


class IncrementalDetokenizer:
    __slots__ = ("_decode", "_skip", "_ids", "_prefix", "_read", "text", "_emitted", "_stop",
                 "_max_stop", "_include_stop", "stop_reason", "_finished")

    def __init__(self, tokenizer, prompt_ids: list[int], params: SamplingParams) -> None:
        self._decode = fast_decode(tokenizer)
        self._skip = params.skip_special_tokens
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        self._emitted = 0
        self._stop = params.stop
        self._max_stop = max((len(s) for s in params.stop), default=0)
        self._include_stop = params.include_stop_str_in_output
        self.stop_reason: str | None = None
        self._finished = False

    def append(self, token_id: int) -> bool:
        """Add one output token; True if a stop string completed (text is cut)."""
        ids = self._ids
        ids.append(token_id)
        before = self._decode(ids[self._prefix:self._read], skip_special_tokens=self._skip)
        after = self._decode(ids[self._prefix:], skip_special_tokens=self._skip)
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        start = len(self.text)
        self.text += after[len(before):]
        self._prefix, self._read = self._read, len(ids)
        if not self._stop:
            return False
        search_from = max(0, start - self._max_stop + 1)
        best = None
        for stop in self._stop:
            at = self.text.find(stop, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return False
        at, stop = best
        self.text = self.text[:at + len(stop)] if self._include_stop else self.text[:at]
        self.stop_reason = stop
        self._finished = True
        return True

    def finish(self) -> None:
        """No more tokens: release any held-back text."""
        self._finished = True

    def _visible(self) -> int:
        if self._finished or not self._stop:
            return len(self.text)
        text = self.text
        for hold in range(min(self._max_stop - 1, len(text)), 0, -1):
            tail = text[-hold:]
            if any(s.startswith(tail) for s in self._stop):
                return len(text) - hold
        return len(text)

    @property
    def visible_text(self) -> str:
        return self.text[:self._visible()]

    def delta(self) -> str:
        """Text that became visible since the last call."""
        end = self._visible()
        if end <= self._emitted:
            return ""
        out = self.text[self._emitted:end]
        self._emitted = end
        return out
