"""Which sequences run in the next step, and with how many tokens: policy only.

Continuous (iteration-level) batching in the style of vLLM's V1 scheduler: every step
has a token budget (``max_num_batched_tokens``) shared by decodes, prompt chunks and
draft tokens, and at most ``max_num_seqs`` sequences run at once.

1. Running sequences first, in the policy's fixed order (fcfs: lower ``priority``
   value first, then arrival; fair: class first). Each asks for its uncomputed tokens:
   one for a decode (plus its draft tokens), the rest of its prompt for a prefill, cut
   to the remaining budget when chunked prefill is on, so a long prompt cannot stall
   the running decodes.
2. When the block pool cannot hold a running sequence's new tokens, the lowest-ranked
   running sequence (the newest of the lowest priority or class) is preempted by
   recompute: its blocks are freed and it goes back to the waiting queue with every
   token it has; it may be the asking sequence itself.
3. If nothing was preempted, waiting sequences are admitted in the order the policy
   gives while budget, sequence slots and blocks last, taking their longest cached
   prefix. Admission stops at the first that does not fit (no overtaking), and leaves a
   small watermark of free blocks so running sequences can grow.

A policy may also cap the prompt tokens some sequences take in a step (fair: lower
classes while a higher one is active): those sequences' prompt chunks are cut to what
the cap has left, or skipped when nothing is left (decodes are never capped), and none
of them is admitted while the cap's number of them runs. A waiting sequence the cap
holds back is passed over, not a stop: the cap is on it, not on those after it.

LoRA (``max_loras``): running sequences use at most that many distinct adapters, so a
step never runs more; a waiting sequence whose adapter would be one too many is passed
over the same way (vLLM's scheduler skips it too).

Aging looks one step ahead: the policy ranks waiting sequences at ``now`` plus the
longest of the last ``LOOKAHEAD_STEPS`` gaps between scheduling points (each at most
``MAX_LOOKAHEAD``), an upper estimate of when the next scheduling point comes, so a
request whose aging bound falls before that point is ranked as it will be then and is
admitted at a step that starts within its bound, not the first one after it. The
longest recent gap, not the last: steps vary (a decode step, then one carrying prompt
chunks), and ranking by the last one let a batch request under a flood start 3 ms past
its 30 s bound when the next step was longer than the one before.

Order is the policy's business (:mod:`llmctl.serve.core.policy`): "fcfs" ranks by
``priority`` then arrival, "fair" by class, aging and each tenant's share. A policy may
also name running sequences that the head of the queue can displace: before step 1,
when the head does not fit, those are preempted (by recompute, newest first) -- only if
that frees enough slots and blocks to admit it; the head is then promised the next
admission, so a displaced sequence cannot take its room back.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from llmctl.serve.core.block_manager import BlockManager
from llmctl.serve.core.policy import FCFSPolicy, PrefillCap, SchedulingPolicy
from llmctl.serve.core.sequence import Sequence, SequenceStatus

# seconds: the aging lookahead's cap (a step is well under a second on the models served
# here; a longer gap between scheduling points is idling, not a step)
MAX_LOOKAHEAD = 1.0
LOOKAHEAD_STEPS = 8  # recent gaps between scheduling points the lookahead takes the max of


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, draft tokens included
    num_spec_tokens: int = 0


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) block copies
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int,
                 max_num_batched_tokens: int, enable_chunked_prefill: bool,
                 watermark: float = 0.01, policy: SchedulingPolicy | None = None,
                 clock: Callable[[], float] = time.time, max_loras: int | None = None) -> None:
        self.block_manager = block_manager
        self.max_loras = max_loras  # distinct LoRA adapters among running sequences
        self.policy = policy or FCFSPolicy()
        self.clock = clock  # the clock of Request.arrival_time (the policy ages with it)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._promised: Sequence | None = None  # admitted next: sequences were preempted for it
        self._last_schedule: float | None = None  # clock() at the last schedule()
        self._aging_now = 0.0  # when this step's ranking is evaluated (module docstring)
        self._gaps: deque[float] = deque(maxlen=LOOKAHEAD_STEPS)  # recent steps' lengths
        self._cap: PrefillCap | None = None  # this step's prefill cap, and its tokens left
        self._capped = 0

    # --- queues ----------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.policy.enqueue(seq)
        bisect.insort(self.waiting, seq, key=self.policy.key)

    def add_running(self, seq: Sequence) -> None:
        """A forked sibling starts running with its parent's blocks."""
        seq.transition(SequenceStatus.RUNNING)
        bisect.insort(self.running, seq, key=self.policy.key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` (stopped, length or aborted) wherever it is, freeing its blocks."""
        if seq.finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
            self.policy.dequeue(seq)
        seq.transition(status)
        seq.spec_token_ids = []
        self.block_manager.free_seq(seq)
        self.policy.release(seq)
        if seq is self._promised:
            self._promised = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free_seq(seq)
        seq.transition(SequenceStatus.PREEMPTED)
        seq.spec_token_ids = []
        self.num_preemptions += 1
        self.add(seq)

    # --- the policy ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._advance_clock()
        out = SchedulerOutput()
        if self.waiting and self.running:
            self._make_room(out)
        cap = self._cap = self.policy.prefill_cap(self.waiting, self.running, self._aging_now)
        self._capped = cap.tokens if cap is not None else 0
        made_room = len(out.preempted)
        budget = self._schedule_running(out)
        # a running sequence that found no blocks preempted one: admit nobody this step
        if len(out.preempted) == made_room:
            self._admit(out, budget)
        self._charge(out)
        return out

    def _advance_clock(self) -> None:
        """Record this scheduling point and set the time the step's ranking is evaluated
        at: now plus the longest recent gap (module docstring)."""
        now = self.clock()
        gap = None if self._last_schedule is None else now - self._last_schedule
        if gap is not None and 0.0 < gap <= MAX_LOOKAHEAD:  # a longer gap was idling
            self._gaps.append(gap)
        self._last_schedule = now
        self._aging_now = now + max(self._gaps, default=0.0)

    def _allowed(self, seq: Sequence, num_new: int) -> int:
        """``num_new`` prompt tokens of ``seq`` cut to this step's prefill cap (0: not
        this step); what it takes is charged to the cap."""
        cap = self._cap
        if cap is None or not cap.applies(seq):
            return num_new
        capped = self._capped
        take = (min(num_new, capped) if self.enable_chunked_prefill
                else (num_new if num_new <= capped else 0))
        self._capped = capped - take
        return take

    def _schedule_running(self, out: SchedulerOutput) -> int:
        """Step 1 and 2 (module docstring): the running sequences' tokens, preempting the
        lowest-ranked when blocks run out; returns the token budget left."""
        budget = self.max_num_batched_tokens
        bm = self.block_manager
        chunked = self.enable_chunked_prefill
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            uncomputed = seq.num_uncomputed_tokens
            spec = len(seq.spec_token_ids) if uncomputed == 1 else 0
            if uncomputed + spec > budget:
                if uncomputed <= budget:
                    spec = budget - uncomputed
                elif chunked:
                    uncomputed, spec = budget, 0
                else:
                    i += 1
                    continue
            if uncomputed > 1 and (uncomputed := self._allowed(seq, uncomputed)) == 0:
                i += 1  # a prompt chunk the cap holds back; the sequence keeps its blocks
                continue
            if spec < len(seq.spec_token_ids):
                del seq.spec_token_ids[spec:]
            num_new = uncomputed + spec
            while (copies := bm.allocate(seq, num_new)) is None:
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.PREEMPTED:
                break
            out.copies.extend(copies)
            out.scheduled.append(ScheduledSeq(seq, num_new, spec))
            budget -= num_new
            i += 1
        return budget

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Step 3 (module docstring): waiting sequences in the policy's order while budget,
        slots, blocks, the prefill cap and ``max_loras`` allow."""
        bm = self.block_manager
        chunked = self.enable_chunked_prefill
        cap = self._cap
        slots = self.max_num_seqs - len(self.running) - sum(s.pending_fork for s in self.running)
        order = self._order() if self.waiting and budget > 0 else []
        capped_running = 0 if cap is None else sum(cap.applies(s) for s in self.running)
        loras = {s.request.lora.lora_id for s in self.running if s.request.lora is not None} \
            if self.max_loras is not None and order else set()
        for seq in order:
            if budget <= 0:
                break
            limited = cap is not None and cap.applies(seq)
            if limited and capped_running >= cap.seqs:
                continue  # one the cap does not hold may come later in the order
            lora = seq.request.lora
            if lora is not None and self.max_loras is not None \
                    and lora.lora_id not in loras and len(loras) >= self.max_loras:
                continue  # its adapter would be one too many; others may still run
            if 1 + seq.pending_fork > slots and self.running:
                break
            cached = bm.find_cached_prefix(seq)
            num_new = seq.num_tokens - len(cached) * bm.block_size
            if num_new > budget:
                if not chunked:
                    break
                num_new = budget
            if (num_new := self._allowed(seq, num_new)) == 0:
                continue
            new_blocks = bm.blocks_needed(len(cached) * bm.block_size + num_new) - len(cached)
            if self.running and bm.num_free_blocks - new_blocks < self.watermark_blocks:
                break
            copies = bm.allocate(seq, num_new, cached)
            if copies is None:
                break
            self.waiting.remove(seq)
            self.policy.dequeue(seq)
            if seq is self._promised:
                self._promised = None
            seq.transition(SequenceStatus.RUNNING)
            bisect.insort(self.running, seq, key=self.policy.key)
            slots -= 1 + seq.pending_fork
            capped_running += limited
            if lora is not None:
                loras.add(lora.lora_id)
            out.copies.extend(copies)
            out.scheduled.append(ScheduledSeq(seq, num_new, 0))
            budget -= num_new

    def _order(self) -> list[Sequence]:
        """The waiting sequences in the policy's order, a promised one first."""
        order = self.policy.order(self.waiting, self._aging_now)
        promised = self._promised
        if promised is not None:
            if promised.status is SequenceStatus.RUNNING or promised.finished:
                self._promised = None
            else:
                order.remove(promised)
                order.insert(0, promised)
        return order

    def _charge(self, out: SchedulerOutput) -> None:
        """Tell the policy which token positions each scheduled sequence computes."""
        for item in out.scheduled:
            self.policy.charge(item.seq, item.seq.num_computed_tokens,
                               item.num_new_tokens - item.num_spec_tokens)

    def _make_room(self, out: SchedulerOutput) -> None:
        """Preempt running sequences the policy lets the head of the queue displace,
        newest first, if (and only if) that frees enough slots and blocks to admit it,
        and, for a head with a LoRA adapter, leaves room for that adapter under
        ``max_loras`` (else the admission below would skip it, after the preemptions)."""
        head = self._order()[0]
        victims = self.policy.preemptible(head, self.running, self._aging_now)
        if not victims or self._promised is not None:
            return
        bm = self.block_manager
        cached = bm.find_cached_prefix(head)
        num_new = head.num_tokens - len(cached) * bm.block_size
        if self.enable_chunked_prefill:
            num_new = min(num_new, self.max_num_batched_tokens)
        need = bm.blocks_needed(len(cached) * bm.block_size + num_new) - len(cached) \
            + bm.revivals(cached)
        slots = self.max_num_seqs - len(self.running) - sum(s.pending_fork for s in self.running)
        free = bm.num_free_blocks
        left = len(self.running)
        chosen: list[Sequence] = []
        adapter = head.request.lora
        # running sequences per adapter id, as the victims leave
        adapters: dict[int, int] = {}
        if adapter is not None and self.max_loras is not None:
            for seq in self.running:
                if seq.request.lora is not None:
                    lid = seq.request.lora.lora_id
                    adapters[lid] = adapters.get(lid, 0) + 1

        def fits() -> bool:
            watermark = self.watermark_blocks if left else 0
            lora_ok = adapter is None or self.max_loras is None \
                or adapter.lora_id in adapters or len(adapters) < self.max_loras
            return (1 + head.pending_fork <= slots or not left) and free - need >= watermark \
                and lora_ok

        for victim in victims:
            if fits():
                break
            chosen.append(victim)
            slots += 1 + victim.pending_fork
            # blocks only it holds return to the pool (shared prefix blocks stay)
            free += bm.exclusive_blocks(victim)
            left -= 1
            if victim.request.lora is not None and victim.request.lora.lora_id in adapters:
                lid = victim.request.lora.lora_id
                adapters[lid] -= 1
                if not adapters[lid]:
                    del adapters[lid]
        if not chosen or not fits():
            return
        for victim in chosen:
            self._preempt(victim)
            self.policy.displaced(victim)
            out.preempted.append(victim)
        self._promised = head
