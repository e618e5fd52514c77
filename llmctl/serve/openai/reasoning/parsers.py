"""The reasoning parsers ``--reasoning-parser`` names (vLLM's names), and what one
parser decides for one request: the phase its output starts in, given the prompt.

Both parsers read ``<think>...</think>``; they differ in what output without a start
tag is:

- ``deepseek_r1``: the DeepSeek-R1 template opens ``<think>`` itself, so the output is
  reasoning until ``</think>`` even without an opening tag (and an unterminated output
  is all reasoning);
- ``qwen3``: reasoning only inside a ``<think>`` the model writes (Qwen3 with thinking
  switched off writes none, and all of it is content).

``harmony`` (gpt-oss; ``openai_gptoss``, vLLM's name for it) reads channels rather
than tags: :mod:`.harmony`.

Either way the prompt has the last word: a prompt whose text ends in an open
``<think>`` (Qwen3-2507's thinking templates) starts the output thinking, one that ends
in ``</think>`` (``enable_thinking: false`` renders ``<think>\\n\\n</think>``) starts it
answering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from llmctl.serve.openai.reasoning.harmony import (
    HarmonyReasoningParser,
    OpenAIGptOssReasoningParser,
)
from llmctl.serve.openai.reasoning.split import Phase, ThinkingSplitter, ThinkTags

# prompt tokens read for its ending: a tag and the blank lines after it fit
_PROMPT_TAIL_TOKENS = 16


class ReasoningParser:
    """A server's parser: the tags as its tokenizer has them, and per request a plan."""

    name: ClassVar[str]
    default_phase: ClassVar[Phase]  # where output starts when the prompt does not say

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.tags = ThinkTags.of(tokenizer)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def first_phase(self, prompt_ids: Sequence[int]) -> Phase:
        tail = self.tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:])).rstrip()
        if tail.endswith(self.tags.start):
            return Phase.THINKING
        if tail.endswith(self.tags.end):
            return Phase.ANSWER
        return self.default_phase

    def plan(self, prompt_ids: Sequence[int]) -> ReasoningPlan:
        return ReasoningPlan(self, self.first_phase(prompt_ids))


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    default_phase = Phase.THINKING


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    default_phase = Phase.BEFORE


# the <think> parsers (ReasoningParser's); harmony's reads channels, not tags
THINK_TAG_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}
REASONING_PARSERS: dict[str, type] = {
    **THINK_TAG_PARSERS,
    **{cls.name: cls for cls in (HarmonyReasoningParser, OpenAIGptOssReasoningParser)}}


def reasoning_parser(name: str | None,
                     tokenizer) -> ReasoningParser | HarmonyReasoningParser | None:
    """The parser ``name`` over ``tokenizer``; None: none asked for. An unknown name is
    a ValueError listing the names (the CLI checks it before anything loads)."""
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of: "
                         f"{', '.join(REASONING_PARSERS)}")
    return REASONING_PARSERS[name](tokenizer)


@dataclass
class ReasoningPlan:
    """One chat request's reasoning: the phase its output starts in."""

    parser: ReasoningParser
    phase: Phase

    def new_choice(self) -> ThinkingSplitter:
        return ThinkingSplitter(self.parser.tags, self.phase, self.parser.decode)

    def gate(self, constraint: Any) -> Any:
        """``constraint`` (a ConstraintFactory for the answer: a response_format or tool
        grammar) held off while the model thinks. That needs the end tag as a token:
        the engine's constraints see tokens, not text; a ValueError otherwise."""
        from llmctl.serve.sample.thinking_gate import ThinkingGate

        if self.phase is Phase.ANSWER:
            return constraint  # no thinking to come: the grammar holds from the first token
        tags = self.parser.tags
        if not tags.by_id:
            raise ValueError(f"this model's tokenizer has no single token for {tags.start} "
                             f"and {tags.end}, so a grammar cannot start after the "
                             f"thinking; switch thinking off (chat_template_kwargs "
                             f'{{"enable_thinking": false}}) or drop the grammar')
        return ThinkingGate(constraint, tags.start_id, tags.end_id,
                            self.phase is Phase.THINKING)
