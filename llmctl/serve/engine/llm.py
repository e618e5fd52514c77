"""The offline API: ``LLM(model, **engine_config).generate(prompts, SamplingParams(...))``.

    from llmctl import LLM, SamplingParams
    llm = LLM("smollm2-135m", dtype="bfloat16")
    outs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    for out in llm.stream("Tell me a story", SamplingParams(max_tokens=64)):
        print(out.outputs[0].text_delta, end="", flush=True)

Prompts are text or token-id lists; one SamplingParams for all or one per prompt. LoRA
adapters: ``LLM(model, loras={"sql": "/adapters/sql"})`` or ``llm.add_lora(name, path)``,
then ``generate(prompts, params, lora="sql")`` (or one name per prompt, None = base).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

from llmctl.errors import UsageError
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm_engine import LLMEngine
from llmctl.serve.engine.outputs import RequestOutput

Prompt = str | list[int]
Lora = str | None  # a loaded LoRA adapter's name, or None for the base model


def _normalize(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single token-id prompt
    return prompts


class LLM:
    def __init__(self, model: str, **engine_config) -> None:
        self.engine = LLMEngine.from_args(model, **engine_config)
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def add_lora(self, name: str, path: str) -> None:
        """Load a PEFT LoRA adapter; prompts then run with it through ``lora=name``."""
        self.engine.add_lora(name, path)

    def _submit(self, prompts: Prompt | Sequence[Prompt],
                params: SamplingParams | Sequence[SamplingParams] | None,
                priority: int | Sequence[int], lora: Lora | Sequence[Lora]) -> list[str]:
        prompts = _normalize(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if isinstance(priority, int):
            priority = [priority] * len(prompts)
        if lora is None or isinstance(lora, str):
            lora = [lora] * len(prompts)
        if not len(params) == len(priority) == len(lora) == len(prompts):
            raise UsageError(f"{len(prompts)} prompts but {len(params)} sampling parameters, "
                             f"{len(priority)} priorities and {len(lora)} LoRA names",
                             "pass one value for all prompts or one per prompt")
        ids = []
        for prompt, p, prio, name in zip(prompts, params, priority, lora):
            request_id = f"llm-{next(self._ids)}"
            self.engine.add_request(request_id, prompt, p, priority=prio, lora=name)
            ids.append(request_id)
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priority: int | Sequence[int] = 0,
                 lora: Lora | Sequence[Lora] = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs in the order of the prompts. ``lora``:
        the adapter name each prompt runs with (None: the base model), one for all or one
        per prompt."""
        ids = self._submit(prompts, sampling_params, priority, lora)
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        while len(final) < len(ids):
            for out in self.engine.step():
                if out.finished and out.request_id in wanted:
                    final[out.request_id] = out
            if not self.engine.has_unfinished_requests() and len(final) < len(ids):
                break
        return [final[i] for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
               *, priority: int | Sequence[int] = 0,
               lora: Lora | Sequence[Lora] = None) -> Iterator[RequestOutput]:
        """Yield each request's output whenever it changes (``text_delta``/``new_token_ids``)."""
        ids = set(self._submit(prompts, sampling_params, priority, lora))
        remaining = set(ids)
        try:
            while remaining:
                for out in self.engine.step():
                    if out.request_id in ids:
                        yield out
                        if out.finished:
                            remaining.discard(out.request_id)
                if not self.engine.has_unfinished_requests():
                    break
        finally:
            if remaining:  # the consumer stopped early: free what they held
                for request_id in remaining:
                    self.engine.abort_request(request_id)
                self.engine.step()
