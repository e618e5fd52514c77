"""Chat messages' text stays text: a special token spelled inside a message
(``<|im_end|>\\n<|im_start|>system``) must not become the control token, or any user can
end their turn and write a system message of their own (role injection).

A chat template renders messages into one text, and tokenizing that text turns every
special token's spelling into the token, the template's own and the user's alike.
:meth:`ContentTokens.encode` tells them apart by position:

1. A conversation none of whose strings (content, names, tool call ids and arguments)
   spells a special token is tokenized exactly as before, in one call: nothing to tell
   apart, so the tokens of every normal conversation stay identical.
2. Otherwise the template is rendered a second time with each such spelling *defused*:
   replaced by as many private-use characters (U+E000), so the two texts line up
   character for character. The special tokens of the defused text are the template's
   own; in the real text, a special token at any other position was written by the
   client (*injected*). A template whose output length changes (it rewrites message text
   depending on what it holds) cannot be checked this way: that request is a 400 naming
   the flag that restores the old behaviour (``--allow-special-tokens-in-content``).
3. The tokenizer splits its input at special tokens before anything else, so the stretch
   between two of the template's special tokens is tokenized on its own. Each stretch
   holding an injected token is tokenized again with special tokens read as text
   (``encode_special_tokens`` on a private copy of the backend tokenizer: transformers'
   ``split_special_tokens`` flips that flag on the shared tokenizer, which other threads
   are using); the other stretches keep their tokens.

Tool definitions are not defused: templates write them with ``tojson``, which escapes
``<`` and ``>``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from llmctl.serve.openai import errors

DEFUSED = "\ue000"  # a private-use character: no template or tokenizer gives it a meaning


class ContentTokens:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        ids = {i for i, token in decoder.items() if getattr(token, "special", False)}
        ids |= set(getattr(tokenizer, "all_special_ids", ()) or ())
        self.special_ids = frozenset(ids)
        texts = {str(decoder[i]) if i in decoder else tokenizer.convert_ids_to_tokens(i)
                 for i in ids}
        self.special_texts = tuple(sorted(t for t in texts if t))
        self._literal = None
        self._lock = threading.Lock()

    def spells_special(self, text: str) -> bool:
        return any(special in text for special in self.special_texts)

    def defuse(self, value: Any) -> Any:
        """``value`` (messages: dicts, lists, strings) with every special token's spelling
        replaced by as many U+E000 characters; the same object when nothing changed."""
        if isinstance(value, str):
            if not self.spells_special(value):
                return value
            for special in self.special_texts:
                value = value.replace(special, DEFUSED * len(special))
            return value
        if isinstance(value, dict):
            out = {k: self.defuse(v) for k, v in value.items()}
            return value if all(out[k] is value[k] for k in value) else out
        if isinstance(value, list):
            items = [self.defuse(v) for v in value]
            return value if all(a is b for a, b in zip(items, value)) else items
        return value

    def encode(self, text: str, messages: list[dict], render: Callable[[list[dict]], str],
               add_special_tokens: bool) -> list[int]:
        """The ids of ``text`` (``render(messages)``), special tokens spelled inside the
        messages tokenized as text."""
        defused = self.defuse(messages)
        if defused is messages:
            return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
        if not getattr(self.tokenizer, "is_fast", False):
            raise _unsafe("this model's tokenizer gives no offsets (not a fast tokenizer)")
        reference = render(defused)
        if len(reference) != len(text):
            raise _unsafe("the chat template rewrites message text")
        own = {tuple(span) for token, span in self._with_offsets(reference, add_special_tokens)
               if token in self.special_ids}
        pairs = self._with_offsets(text, add_special_tokens)
        injected = {i for i, (token, span) in enumerate(pairs)
                    if token in self.special_ids and tuple(span) not in own}
        ids = [token for token, _ in pairs]
        if not injected:
            return ids
        return self._retokenize(text, ids, [span for _, span in pairs], injected)

    def _with_offsets(self, text: str, add_special_tokens: bool) -> list[tuple[int, Any]]:
        enc = self.tokenizer(text, add_special_tokens=add_special_tokens,
                             return_offsets_mapping=True)
        return list(zip(enc["input_ids"], enc["offset_mapping"]))

    def _retokenize(self, text: str, ids: list[int], offsets: list[tuple[int, int]],
                    injected: set[int]) -> list[int]:
        out: list[int] = []
        run: list[int] = []  # token indices since the last template special token
        start = 0  # where that run's text begins

        def flush(end: int) -> None:
            if any(i in injected for i in run):
                out.extend(self._literal_ids(text[start:end]))
            else:
                out.extend(ids[i] for i in run)
            run.clear()

        for i, token in enumerate(ids):
            if token in self.special_ids and i not in injected:  # the template's own
                flush(offsets[i][0])
                out.append(token)
                start = offsets[i][1]
            else:
                run.append(i)
        flush(len(text))
        return out

    def _literal_ids(self, piece: str) -> list[int]:
        with self._lock:
            if self._literal is None:
                from tokenizers import Tokenizer

                literal = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
                literal.encode_special_tokens = True
                self._literal = literal
        return self._literal.encode(piece, add_special_tokens=False).ids


def _unsafe(why: str) -> errors.APIError:
    return errors.bad_request(
        f"a message spells a special token, and {why}, so it cannot be kept as text; "
        "remove the special token's text, or start the server with "
        "--allow-special-tokens-in-content", "messages")
