"""Turn a scheduled step into tensors, run the model, return the logits that matter.

Input of a step: for each scheduled sequence, the tokens from its ``num_computed_tokens``
on (a prompt chunk, or the last sampled token) followed by its draft tokens. Output:
logits rows for every sequence that has caught up with its tokens, one row for a plain
decode or prefill end, ``1 + k`` rows when ``k`` draft tokens are verified.

Prompt log-probs (:meth:`ModelRunner.execute_with_prompt`): for a request that asks,
the rows of every prompt position in the chunk too (position ``p`` scores prompt token
``p + 1``), computed only for that request. Runners without this method (engine
directories) serve no prompt log-probs; the engine refuses such requests.

Embeddings (a request with ``Request.pooled``): :meth:`ModelRunner.execute_with_prompt`
returns the final hidden states of the prompt positions its pooling reads
(:class:`PooledRows`: every position for mean pooling, the last for last-token pooling)
in place of logits rows: such a sequence is never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmctl.serve.core.scheduler import ScheduledSeq
from llmctl.serve.kernels.cpu import paged_attention_kernel, prefill_attention_kernel
from llmctl.serve.layers.attention import (
    AttnGroup,
    AttnMetadata,
    build_kernel_group,
    build_paged_group,
)
from llmctl.serve.lora.batch import LoRABatch
from llmctl.serve.model.decoder import LlamaModel


class RunnerSeq:
    """A sequence as the runner reads it, without a request behind it: the draft model's
    view of a target sequence (speculative decoding), a scored token list (scoring)."""

    __slots__ = ("token_ids", "num_computed_tokens", "block_table", "spec_token_ids",
                 "num_hashed_blocks", "chain_hash", "num_cached_tokens", "base")

    def __init__(self) -> None:
        self.base = 0  # target length when the drafts were proposed
        self.token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.spec_token_ids: list[int] = []
        self.num_hashed_blocks = 0
        self.chain_hash = b""
        self.num_cached_tokens = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass
class LogitRows:
    item: ScheduledSeq
    start: int  # first row in the logits tensor
    count: int  # 1 + number of draft tokens


@dataclass
class PromptLogits:
    item: ScheduledSeq
    first: int  # index of the prompt token that row 0 scores
    logits: torch.Tensor  # [rows, vocab]: rows scoring prompt tokens first, first + 1, ...


@dataclass
class PooledRows:
    item: ScheduledSeq
    first: int  # the prompt position of row 0
    hidden: torch.Tensor  # [rows, hidden]: final hidden states of positions first, first + 1, ...


# what execute_with_prompt returns besides the sampled rows, per request that asked
PromptRows = PromptLogits | PooledRows


def slot_ids(table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of positions ``[start, end)`` for a block table (block-wise ranges)."""
    out: list[int] = []
    for b in range(start // block_size, (end - 1) // block_size + 1):
        base = table[b] * block_size
        lo = max(start, b * block_size) - b * block_size
        hi = min(end, (b + 1) * block_size) - b * block_size
        out.extend(range(base + lo, base + hi))
    return out


def context_buckets(items: list[ScheduledSeq], spread: float = 2.0) -> list[list[ScheduledSeq]]:
    """Split a group by context length so padding to the longest stays under ``spread``x.

    Gathered K/V are padded to the longest context of a group; with contexts of 40 and
    700 tokens in one batch most of the copy would be padding. Sorted and cut where the
    length exceeds ``spread`` times the bucket's shortest, the waste is bounded at the
    price of one attention call per bucket.
    """
    if len(items) < 4:
        return [items]
    ordered = sorted(items, key=lambda i: i.seq.num_computed_tokens)
    buckets = [[ordered[0]]]
    floor = max(ordered[0].seq.num_computed_tokens, 64)
    for item in ordered[1:]:
        ctx = item.seq.num_computed_tokens
        if ctx > spread * floor:
            buckets.append([])
            floor = ctx
        buckets[-1].append(item)
    return buckets


# Paged groups of up to this many query tokens per sequence go to the native kernel
# (decodes, draft verification); longer prompt chunks keep gather + SDPA, whose
# matrix-matrix products win once many queries share each K/V row.
KERNEL_MAX_Q_LEN = 32


def _adapter(item: ScheduledSeq):
    """The LoRA adapter a scheduled sequence runs with (None: the base model, or a
    sequence without a request: scoring's and the draft model's shadows)."""
    request = getattr(item.seq, "request", None)
    return None if request is None else request.lora


def _by_adapter(items: list[ScheduledSeq]) -> list[ScheduledSeq]:
    """A group's sequences with each adapter's together (base first), so that its rows
    are one range (:mod:`llmctl.serve.lora.batch`); order within a group is free."""
    return sorted(items, key=lambda i: getattr(_adapter(i), "lora_id", 0))


class _StepInputs:
    """One step's flat model inputs, built sequence by sequence in the order of its
    attention groups: tokens, positions and cache slots, the hidden rows whose logits are
    sampled and those that score prompt tokens, and each adapter's run of rows."""

    __slots__ = ("adapters", "block_size", "groups", "logit_index", "lora_runs", "order",
                 "pooled_index", "pooled_parts", "positions", "prompt_index", "prompt_parts",
                 "rows", "slots", "tokens", "with_prompt")

    def __init__(self, block_size: int, *, with_prompt: bool, adapters: bool) -> None:
        self.block_size = block_size
        self.with_prompt = with_prompt
        self.adapters = adapters  # some sequence runs with a LoRA adapter
        # a group's sequences in row order: each adapter's together when adapters run
        self.order = _by_adapter if adapters else list
        self.tokens: list[int] = []
        self.slots: list[int] = []
        self.positions: list[int] = []
        self.groups: list[AttnGroup] = []
        self.rows: list[LogitRows] = []
        self.logit_index: list[int] = []
        self.prompt_index: list[int] = []
        self.prompt_parts: list[tuple[ScheduledSeq, int, int]] = []  # (item, first token, rows)
        self.lora_runs: list[tuple[object, int, int]] = []  # (adapter, first row, end row)
        self.pooled_index: list[int] = []  # embeddings' hidden rows (PooledRows)
        self.pooled_parts: list[tuple[ScheduledSeq, int, int]] = []  # (item, position, rows)

    def add_all(self, items: list[ScheduledSeq]) -> int:
        """Add a group's sequences; returns its first token's row."""
        start = len(self.tokens)
        for item in items:
            self.add(item)
        return start

    def add(self, item: ScheduledSeq) -> None:
        seq = item.seq
        tokens = self.tokens
        c, n, k = seq.num_computed_tokens, item.num_new_tokens, item.num_spec_tokens
        if self.with_prompt and seq.request.needs_prompt_logits:
            # positions c .. end - 1 score prompt tokens c + 1 .. end; the prompt's
            # last position scores the first output token (a sampling row)
            end = min(c + n - k, seq.num_prompt_tokens - 1)
            if end > c:
                base = len(tokens)
                self.prompt_index.extend(range(base, base + end - c))
                self.prompt_parts.append((item, c + 1, end - c))
        first_row = len(tokens)
        tokens.extend(seq.token_ids[c:c + n - k])
        if k:
            tokens.extend(seq.spec_token_ids[:k])
        if self.adapters:
            self.lora_runs.append((_adapter(item), first_row, len(tokens)))
        self.positions.extend(range(c, c + n))
        self.slots.extend(slot_ids(seq.block_table, c, c + n, self.block_size))
        pooled = seq.request.pooled if self.with_prompt else None
        if pooled is not None:  # an embedding: hidden rows, never a logits row
            if pooled.every_position:
                self.pooled_index.extend(range(first_row, first_row + n))
                self.pooled_parts.append((item, c, n))
            elif c + n == seq.num_tokens:
                self.pooled_index.append(first_row + n - 1)
                self.pooled_parts.append((item, c + n - 1, 1))
            return
        if c + n - k == seq.num_tokens:
            logit_index = self.logit_index
            self.rows.append(LogitRows(item, len(logit_index), 1 + k))
            end = len(tokens)
            logit_index.extend(range(end - 1 - k, end))


class ModelRunner:
    def __init__(self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int,
                 with_lora: bool = False, kv_scales: torch.Tensor | None = None) -> None:
        self.model = model
        # requests' LoRA adapters apply here (the target model; a draft model runs bare)
        self.with_lora = with_lora
        self.kv_cache = kv_cache
        # an 8-bit cache's scales (llmctl.serve.layers.kv_quant): int8's per slot, moved with its
        # blocks; fp8's static per layer and KV head
        self.kv_scales = kv_scales
        self.block_size = block_size
        # what attention computes in: the cache dtype for a float cache (queries are cast
        # to it), the model's for an 8-bit one (its K/V are dequantized as they are read)
        self.attn_dtype = model.dtype if kv_scales is not None else kv_cache.dtype
        self.device = model.device
        self.group_heads = model.spec.num_heads // model.spec.num_kv_heads
        # the layers' sliding windows (a gathered group gets a mask for each), and the
        # largest when every layer has one: keys before it are never gathered
        self.windows = sorted({w for w in model.spec.layer_windows if w})
        self.kv_window = model.spec.kv_window
        self.kernel = paged_attention_kernel(
            self.device, self.attn_dtype, codes=kv_cache.dtype if kv_scales is not None else None)
        self.prefill = prefill_attention_kernel(self.device, self.attn_dtype)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]
        if self.kv_scales is not None and self.kv_scales.dim() == 5:  # per slot (int8)
            self.kv_scales[:, :, dst] = self.kv_scales[:, :, src]

    def execute(self, scheduled: list[ScheduledSeq]) -> tuple[torch.Tensor, list[LogitRows]]:
        logits, rows, _ = self.execute_with_prompt(scheduled, with_prompt=False)
        return logits, rows

    @torch.inference_mode()
    def execute_with_prompt(self, scheduled: list[ScheduledSeq], with_prompt: bool = True
                            ) -> tuple[torch.Tensor, list[LogitRows], list[PromptRows]]:
        """:meth:`execute` plus the prompt rows of requests that want prompt log-probs
        and the hidden rows of embedding requests (which get no logits rows)."""
        fresh: dict[int, list[ScheduledSeq]] = {}
        by_len: dict[int, list[ScheduledSeq]] = {}
        for s in scheduled:
            (by_len if s.seq.num_computed_tokens else fresh).setdefault(
                s.num_new_tokens, []).append(s)
        adapters = self.with_lora and any(_adapter(s) is not None for s in scheduled)
        step = _StepInputs(self.block_size, with_prompt=with_prompt, adapters=adapters)
        for q_len, items in fresh.items():
            items = step.order(items)
            start = step.add_all(items)
            step.groups.append(AttnGroup(start=start, end=len(step.tokens),
                                         num_seqs=len(items), q_len=q_len, fresh=True))
        for q_len, items in sorted(by_len.items()):
            self._add_paged(step, q_len, step.order(items))
        hidden = self._forward(step)
        prompt: list[PromptRows] = [*self._prompt_logits(step, hidden),
                                    *self._pooled_rows(step, hidden)]
        if not step.logit_index:
            return torch.empty((0, self.model.spec.vocab_size)), step.rows, prompt
        selected = hidden[torch.tensor(step.logit_index, dtype=torch.long, device=self.device)]
        return self.model.logits(selected), step.rows, prompt

    def _add_paged(self, step: _StepInputs, q_len: int, items: list[ScheduledSeq]) -> None:
        """Sequences with cached context and ``q_len`` new tokens each: one native-kernel
        group when the queries are short, else gather + SDPA groups by context bucket."""
        if self.kernel is not None and q_len <= KERNEL_MAX_Q_LEN:
            # no padding to bucket against: one group however the contexts spread
            start = step.add_all(items)
            step.groups.append(build_kernel_group(
                start, q_len, [i.seq.num_computed_tokens + q_len for i in items],
                [i.seq.block_table for i in items], device=self.device))
            return
        bs = self.block_size
        for bucket in context_buckets(items):
            bucket = step.order(bucket)
            start = step.add_all(bucket)
            first_block = 0
            if self.kv_window is not None:  # the earliest key any query of it reads
                first_block = max(0, min(i.seq.num_computed_tokens for i in bucket)
                                  - self.kv_window + 1) // bs
            step.groups.append(build_paged_group(
                start, q_len, [i.seq.num_computed_tokens + q_len for i in bucket],
                [i.seq.block_table for i in bucket], block_size=bs,
                num_blocks=self.kv_cache.shape[2], group_heads=self.group_heads,
                device=self.device, dtype=self.attn_dtype, windows=self.windows,
                first_block=first_block))

    def _forward(self, step: _StepInputs) -> torch.Tensor:
        """The model's last hidden states for every token of the step."""
        dev = self.device
        meta = AttnMetadata(slot_mapping=torch.tensor(step.slots, dtype=torch.long, device=dev),
                            groups=step.groups, kernel=self.kernel, prefill=self.prefill)
        lora = LoRABatch.from_runs(step.lora_runs, dev) if step.adapters else None
        return self.model.forward(torch.tensor(step.tokens, dtype=torch.long, device=dev),
                                  torch.tensor(step.positions, dtype=torch.long, device=dev),
                                  meta, self.kv_cache, kv_scales=self.kv_scales, lora=lora)

    def _prompt_logits(self, step: _StepInputs, hidden: torch.Tensor) -> list[PromptLogits]:
        """The logits of the prompt rows, one slice per request that asked (one head call)."""
        prompt: list[PromptLogits] = []
        if step.prompt_index:
            all_rows = self.model.logits(
                hidden[torch.tensor(step.prompt_index, dtype=torch.long, device=self.device)])
            offset = 0
            for item, first, count in step.prompt_parts:
                prompt.append(PromptLogits(item, first, all_rows[offset:offset + count]))
                offset += count
        return prompt

    def _pooled_rows(self, step: _StepInputs, hidden: torch.Tensor) -> list[PooledRows]:
        """The hidden rows embedding requests pool, one slice per request."""
        if not step.pooled_index:
            return []
        rows = hidden[torch.tensor(step.pooled_index, dtype=torch.long, device=self.device)]
        out, offset = [], 0
        for item, first, count in step.pooled_parts:
            out.append(PooledRows(item, first, rows[offset:offset + count]))
            offset += count
        return out
