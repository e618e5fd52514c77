"""Engine outputs -> OpenAI response bodies and stream chunks (pure functions)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Update:
    """What one engine output adds to one choice."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[Any] | None  # TokenLogprobs for the new tokens, when requested
    # chat with a reasoning parser: the thinking part (``text`` is then the answer part)
    # and how many of ``token_ids`` were thinking
    reasoning: str = ""
    reasoning_tokens: int = 0


def updates_from_output(out) -> list[Update]:
    updates = []
    for c in out.outputs:
        new = len(c.new_token_ids)
        logprobs = c.logprobs[len(c.logprobs) - new:] if c.logprobs is not None else None
        if new or c.text_delta or c.finish_reason:
            updates.append(Update(c.index, list(c.new_token_ids), c.text_delta,
                                  _finish(c.finish_reason), logprobs))
    return updates


@dataclass
class NoContext:
    """The logprob entry of a prompt's first token: nothing to condition on (null)."""

    token_id: int
    logprob: None = None
    top: None = None


def echo_prefix(upd: Update, prompt_text: str, prompt_logprobs: list[Any] | None,
                prompt_ids: list[int]) -> Update:
    """``upd`` with the prompt in front: its text, and its log-probs when the choice has
    them (entry 0 has no context). Token counts stay those of the completion."""
    logprobs = upd.logprobs
    if prompt_logprobs is not None:
        head = [NoContext(prompt_ids[0]) if e is None else e for e in prompt_logprobs]
        logprobs = head + (logprobs or [])
    return Update(upd.index, upd.token_ids, prompt_text + upd.text, upd.finish_reason,
                  logprobs)


def without_generation(upd: Update) -> Update:
    """Echo with ``max_tokens: 0``: the one token the engine had to sample is dropped."""
    return Update(upd.index, [], "", "length" if upd.finish_reason else None,
                  [] if upd.logprobs is not None else None)


class TokenIdNames:
    """Stands in for the tokenizer when tokens are to be named ``token_id:N`` (vLLM's
    ``return_tokens_as_token_ids``): exact ids where texts could be ambiguous."""

    @staticmethod
    def decode(ids: list[int]) -> str:
        return "".join(f"token_id:{i}" for i in ids)


def _finish(reason: str | None) -> str | None:
    # OpenAI knows stop and length; an aborted request that still answers is cut short.
    return {"abort": "length"}.get(reason, reason) if reason else None


@dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[Any] = field(default_factory=list)
    wants_logprobs: bool = False
    tool_calls: list[dict[str, Any]] | None = None  # chat: the calls read out of ``text``
    reasoning: str | None = None  # chat with a reasoning parser: the thinking
    reasoning_tokens: int = 0

    def add(self, upd: Update) -> None:
        self.text += upd.text
        if upd.reasoning:
            self.reasoning = (self.reasoning or "") + upd.reasoning
        self.reasoning_tokens += upd.reasoning_tokens
        self.num_tokens += len(upd.token_ids)
        if upd.finish_reason:
            self.finish_reason = upd.finish_reason
        if upd.logprobs is not None:
            self.wants_logprobs = True
            self.logprobs.extend(upd.logprobs)


def usage_block(prompt_tokens: int, completion_tokens: int,
                reasoning_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; ``reasoning_tokens`` (with a reasoning parser) goes in
    ``completion_tokens_details`` (it is part of ``completion_tokens``)."""
    usage: dict[str, Any] = {"prompt_tokens": prompt_tokens,
                             "completion_tokens": completion_tokens,
                             "total_tokens": prompt_tokens + completion_tokens}
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return usage


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(entries: list[Any], tokenizer, offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape: parallel arrays plus a top-n dict per position."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    pos = offset
    for e in entries:
        text = _token_text(tokenizer, e.token_id)
        tokens.append(text)
        token_logprobs.append(e.logprob)
        alternatives: dict[str, float] = {}
        for t, lp in e.top or ():  # distinct ids can decode alike (partial UTF-8): keep the best
            alternatives.setdefault(_token_text(tokenizer, t), lp)
        top.append(alternatives if e.top is not None else None)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(entries: list[Any], tokenizer) -> dict[str, Any]:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**item(e.token_id, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]}


def completion_response(rid: str, created: int, model: str, choices: list[Choice],
                        usage: dict, tokenizer) -> dict[str, Any]:
    return {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": c.index, "text": c.text, "finish_reason": c.finish_reason,
                     "logprobs": completion_logprobs(c.logprobs, tokenizer)
                     if c.wants_logprobs else None} for c in choices],
        "usage": usage,
    }


def chat_response(rid: str, created: int, model: str, choices: list[Choice], usage: dict,
                  tokenizer=None) -> dict[str, Any]:
    return {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": c.index,
                     "message": chat_message(c.text, c.tool_calls, c.reasoning),
                     "finish_reason": c.finish_reason,
                     "logprobs": chat_logprobs(c.logprobs, tokenizer)
                     if c.wants_logprobs and tokenizer is not None else None}
                    for c in choices],
        "usage": usage,
    }


def chat_message(content: str, tool_calls: list[dict[str, Any]] | None,
                 reasoning: str | None = None) -> dict[str, Any]:
    """OpenAI's assistant message: with tool calls, content is null when empty. With a
    reasoning parser (``reasoning`` not None) the thinking is in ``reasoning`` (vLLM's
    field) and ``reasoning_content`` (its older name, which clients still read), and an
    empty answer (``max_tokens`` reached while thinking) is null, not "" ."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        message.update(content=content or None, reasoning=reasoning or None,
                       reasoning_content=reasoning or None)
    if tool_calls:
        message.update(content=content or None, tool_calls=tool_calls)
    return message


def completion_chunk(rid: str, created: int, model: str, index: int, upd: Update,
                     tokenizer) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": upd.text, "finish_reason": upd.finish_reason,
                         "logprobs": completion_logprobs(upd.logprobs, tokenizer)
                         if upd.logprobs is not None else None}]}


def chat_chunk(rid: str, created: int, model: str, index: int, upd: Update, first: bool,
               tokenizer=None, tool_calls: list[dict[str, Any]] | None = None
               ) -> dict[str, Any]:
    """``tool_calls``: the chunk's call deltas (index, then id, type and name once, then
    pieces of arguments), as OpenAI streams them."""
    delta: dict[str, Any] = {"role": "assistant"} if first else {}
    if upd.reasoning:  # its own deltas, under both names (as in chat_message)
        delta["reasoning"] = delta["reasoning_content"] = upd.reasoning
    if upd.text or (first and not upd.reasoning):
        delta["content"] = upd.text if upd.text or tool_calls is None else None
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "finish_reason": upd.finish_reason,
                         "logprobs": chat_logprobs(upd.logprobs, tokenizer)
                         if upd.logprobs is not None and tokenizer is not None else None}]}
