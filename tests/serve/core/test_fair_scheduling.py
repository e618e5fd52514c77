"""The "fair" scheduling policy in the scheduler and the engine, and deadline admission.

Synthetic sequences for the scheduler's preemption rules; the tiny model for the engine
(float32 greedy, so a recomputed sequence must give exactly the tokens it would have).
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmctl.serve.core.block_manager import BlockManager
from llmctl.serve.core.policy import FairPolicy
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.scheduler import Scheduler
from llmctl.serve.core.sequence import Request, SequenceStatus
from tests.serve.core.test_scheduler import run_step

GREEDY = {"temperature": 0, "ignore_eos": True}


class Clock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


# --- the scheduler, synthetic sequences ---------------------------------------------------
def make_seq(n_tokens, *, cls=None, tenant=None, arrival=0.0, rid="r"):
    req = Request(rid, list(range(1, n_tokens + 1)), SamplingParams(), prompt=None,
                  priority=0, arrival_time=arrival, eos_token_ids=frozenset(), tenant=tenant,
                  priority_class=cls)
    return req.seqs[0]


def make(num_blocks, *, fair=True, clock=None, budget=64, max_seqs=8):
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs=max_seqs,
                     max_num_batched_tokens=budget, enable_chunked_prefill=True,
                     watermark=0.0, policy=FairPolicy(aging_seconds=100) if fair else None,
                     clock=clock or Clock())


def three_batch_sequences_fill_the_pool(sched):
    """6 blocks of 4: three 7-token batch sequences take them all (2 blocks each)."""
    batch = [make_seq(7, cls="batch", tenant="A", arrival=i, rid=f"b{i}") for i in range(3)]
    for seq in batch:
        sched.add(seq)
    run_step(sched)  # each now holds 8 tokens, 7 computed, in 2 blocks
    assert sched.block_manager.num_free_blocks == 0
    return batch


@pytest.mark.parametrize("fair", [True, False])
def test_a_waiting_interactive_request_displaces_the_newest_batch_sequence(fair):
    sched = make(6, fair=fair)
    batch = three_batch_sequences_fill_the_pool(sched)
    urgent = make_seq(7, cls="interactive", tenant="B", arrival=5, rid="urgent")
    sched.add(urgent)
    out = run_step(sched)
    if not fair:  # fcfs never preempts for a waiting request: it waits for blocks
        assert out.preempted == [] and urgent.status is SequenceStatus.WAITING
        return
    assert out.preempted == [batch[2]]
    assert batch[2].status is SequenceStatus.PREEMPTED and batch[2].block_table == []
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == \
        [(batch[0], 1), (batch[1], 1), (urgent, 7)]
    assert sched.waiting == [batch[2]]
    sched.block_manager.check_invariants(sched.running)


def test_no_preemption_unless_it_admits_the_waiting_request():
    sched = make(6)
    three_batch_sequences_fill_the_pool(sched)
    # 30 tokens need 8 blocks: more than the pool holds, preempting everything or not
    sched.add(make_seq(30, cls="interactive", tenant="B", arrival=5, rid="huge"))
    out = run_step(sched)
    assert out.preempted == [] and len(sched.running) == 3


def test_only_a_lower_class_is_displaced():
    sched = make(6)
    for i in range(3):
        sched.add(make_seq(7, cls="interactive", tenant="A", arrival=i, rid=f"i{i}"))
    run_step(sched)
    sched.add(make_seq(7, cls="interactive", tenant="B", arrival=5, rid="late"))
    out = run_step(sched)
    assert out.preempted == [] and [s.request.request_id for s in sched.waiting] == ["late"]


def test_displacement_leaves_room_for_the_head_adapter_under_max_loras():
    """max_loras 2, running adapters L1, L2, L2: an interactive request with a third
    adapter needs both L2 sequences gone, not only the newest (which frees the blocks
    but leaves two adapters, so the admission would skip it after the preemption)."""
    from llmctl.serve.lora.adapter import LoRAAdapter

    sched = make(6)
    sched.max_loras = 2
    loras = [LoRAAdapter(name=f"l{i}", path="", rank=1, scaling=1.0, layers=[])
             for i in range(3)]
    batch = [make_seq(7, cls="batch", tenant="A", arrival=i, rid=f"b{i}") for i in range(3)]
    for seq, lora in zip(batch, (loras[0], loras[1], loras[1])):
        seq.request.lora = lora
        sched.add(seq)
    run_step(sched)
    urgent = make_seq(7, cls="interactive", tenant="B", arrival=5, rid="urgent")
    urgent.request.lora = loras[2]
    sched.add(urgent)
    out = run_step(sched)
    assert out.preempted == [batch[2], batch[1]]
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(batch[0], 1), (urgent, 7)]
    sched.block_manager.check_invariants(sched.running)


def test_a_sequence_is_displaced_at_most_once():
    """Displaced once, a batch sequence keeps its place against later interactive
    arrivals: otherwise a steady interactive stream could push it out forever."""
    sched = make(6)
    batch = three_batch_sequences_fill_the_pool(sched)
    sched.add(make_seq(7, cls="interactive", tenant="B", arrival=5, rid="i1"))
    assert run_step(sched).preempted == [batch[2]]
    sched.finish(sched.running[0], SequenceStatus.FINISHED_STOPPED)  # i1 ends: 2 blocks free
    run_step(sched)  # batch[2] (9 tokens, 3 blocks) cannot fit yet; nothing else waits
    for seq in list(sched.running):
        if seq is not batch[2]:
            sched.finish(seq, SequenceStatus.FINISHED_STOPPED)
    run_step(sched)  # b2 runs again, alone
    assert batch[2].status is SequenceStatus.RUNNING
    for i in range(2):  # fill the rest of the pool with two more batch sequences
        sched.add(make_seq(3, cls="batch", tenant="A", arrival=10 + i, rid=f"x{i}"))
    run_step(sched)
    sched.add(make_seq(7, cls="interactive", tenant="B", arrival=20, rid="i2"))
    out = run_step(sched)
    assert batch[2] not in out.preempted and batch[2].status is SequenceStatus.RUNNING


def test_lower_prompts_are_held_back_while_a_higher_class_waits_then_capped_while_active():
    """A standard prompt chunks at the full budget alone; once an interactive request
    waits, the step carries the interactive prompt and the running decode only; while the
    interactive class stays active (ACTIVE_SECONDS after its arrival) standard prompts
    get GUARD_TOKENS per step between them; after that, the full budget again."""
    from llmctl.serve.core.policy import ACTIVE_SECONDS, GUARD_TOKENS

    clock = Clock(10.0)
    sched = make(1000, clock=clock, budget=256)
    decode = make_seq(4, cls="standard", tenant="A", arrival=10.0, rid="d")
    sched.add(decode)
    run_step(sched)  # d's prompt; it decodes from now on
    long = make_seq(600, cls="standard", tenant="A", arrival=10.0, rid="long")
    sched.add(long)
    out = run_step(sched)
    assert {i.seq.request.request_id: i.num_new_tokens for i in out.scheduled} == {
        "d": 1, "long": 255}
    clock.t = 11.0
    inter = make_seq(20, cls="interactive", tenant="B", arrival=11.0, rid="i")
    sched.add(inter)
    out = run_step(sched)  # i waits at the start of the step: no standard prompt tokens
    assert {i.seq.request.request_id: i.num_new_tokens for i in out.scheduled} == {
        "d": 1, "i": 20}
    out = run_step(sched)  # i decodes; the class is active: standard prompts share the cap
    assert {i.seq.request.request_id: i.num_new_tokens for i in out.scheduled} == {
        "d": 1, "long": GUARD_TOKENS, "i": 1}
    clock.t = 11.0 + ACTIVE_SECONDS
    out = run_step(sched)
    assert {i.seq.request.request_id: i.num_new_tokens for i in out.scheduled} == {
        "d": 1, "long": 254, "i": 1}


@pytest.mark.parametrize("previous,first", [
    ((18.5,), "batch"), ((), "inter"), ((17.9, 18.9, 19.3), "batch"),
    ((16.0, 18.9, 19.3), "inter")])
def test_aging_looks_one_step_ahead(previous, first):
    """A batch request (aging 10 s: top level at 20 s) and a newer interactive one, one
    admission per step. At 19.5 s, the longest recent gap between scheduling points
    being 1 s, the next one may come past the batch request's bound: it goes first (same
    level, earlier arrival); so it does when the last gap was 0.2 s but one before it
    1 s. With no earlier scheduling point, or only gaps so short that the next point
    comes before 20 s (a 2.9 s gap is idling, not a step), the interactive one goes first."""
    clock = Clock(0.0)
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=1, max_num_batched_tokens=64,
                      enable_chunked_prefill=True, watermark=0.0,
                      policy=FairPolicy(aging_seconds=10), clock=clock)
    for t in previous:
        clock.t = t
        assert sched.schedule().empty  # nothing waits yet; the point is recorded
    sched.add(make_seq(8, cls="batch", tenant="X", arrival=0.0, rid="batch"))
    sched.add(make_seq(8, cls="interactive", tenant="Y", arrival=19.0, rid="inter"))
    clock.t = 19.5
    assert [i.seq.request.request_id for i in run_step(sched).scheduled] == [first]


def test_no_new_lower_sequence_while_guard_seqs_run_and_a_higher_class_is_active():
    from llmctl.serve.core.policy import ACTIVE_SECONDS, GUARD_SEQS

    clock = Clock(10.0)
    sched = make(1000, clock=clock, budget=512, max_seqs=32)
    sched.add(make_seq(4, cls="interactive", tenant="B", arrival=10.0, rid="i"))
    for k in range(12):
        sched.add(make_seq(4, cls="standard", tenant="A", arrival=10.0, rid=f"a{k}"))
    run_step(sched)  # i waits at the start: no standard prompt this step
    run_step(sched)
    running = [s.request.request_id for s in sched.running]
    assert "i" in running and len(running) == 1 + GUARD_SEQS
    clock.t = 10.0 + ACTIVE_SECONDS  # the class went quiet: the others start
    run_step(sched)
    assert len(sched.running) == 13


def test_a_flood_past_its_aging_bound_stays_inside_the_guard_but_one_due_per_tenant_passes():
    """Twelve standard requests of tenant A waited far past their aging bound (10 s) when
    an interactive request arrives. The guard goes by base class: A's first due request
    passes it (its tenant has nothing inside), then only GUARD_SEQS more of A start.
    A due batch request of another tenant passes too; a batch request not yet due
    does not (yet); once the interactive class goes quiet the rest of A start."""
    from llmctl.serve.core.policy import ACTIVE_SECONDS, GUARD_SEQS

    clock = Clock(100.0)
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=32, max_num_batched_tokens=512,
                      enable_chunked_prefill=True, watermark=0.0,
                      policy=FairPolicy(aging_seconds=10), clock=clock)
    for k in range(12):
        sched.add(make_seq(4, cls="standard", tenant="A", arrival=float(k), rid=f"a{k}"))
    sched.add(make_seq(4, cls="interactive", tenant="B", arrival=100.0, rid="i"))
    out = run_step(sched)  # i waits: no capped prompt; a0 passes the guard
    assert {i.seq.request.request_id for i in out.scheduled} == {"i", "a0"}
    for t in (100.5, 101.0):
        clock.t = t
        run_step(sched)
    running = sorted(s.request.request_id for s in sched.running)
    assert running == sorted(["i", "a0"] + [f"a{k}" for k in range(1, 1 + GUARD_SEQS)])
    sched.add(make_seq(4, cls="batch", tenant="P", arrival=80.0, rid="probe"))  # due at 100
    sched.add(make_seq(4, cls="batch", tenant="Q", arrival=95.0, rid="young"))
    clock.t = 101.5
    out = run_step(sched)
    assert [i.seq.request.request_id for i in out.scheduled if i.num_new_tokens > 1] == \
        ["probe"]
    clock.t = 100.0 + ACTIVE_SECONDS
    run_step(sched)  # A's class is now the top one: all of A runs; young, due by now, too
    assert sched.waiting == [] and len(sched.running) == 1 + 12 + 2


def test_a_due_request_displaces_a_flood_sequence_when_no_slot_is_free():
    """Two slots held by tenant A's standard sequences (decoding; A has the larger
    counter). A batch request of tenant P (aging bound 2 x 10 s) waits: before its bound
    it displaces nothing; at its bound it displaces A's newest and runs."""
    clock = Clock(0.0)
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=2, max_num_batched_tokens=64,
                      enable_chunked_prefill=True, watermark=0.0,
                      policy=FairPolicy(aging_seconds=10), clock=clock)
    flood = [make_seq(8, cls="standard", tenant="A", arrival=0.0, rid=f"a{k}")
             for k in range(2)]
    for seq in flood:
        sched.add(seq)
    run_step(sched)
    sched.add(make_seq(8, cls="batch", tenant="P", arrival=0.0, rid="probe"))
    clock.t = 10.0
    out = run_step(sched)  # not due: waits for a slot
    assert out.preempted == [] and {s.request.request_id for s in sched.running} == \
        {"a0", "a1"}
    clock.t = 20.0
    out = run_step(sched)
    assert out.preempted == [flood[1]]
    assert [i.seq.request.request_id for i in out.scheduled if i.num_new_tokens > 1] == \
        ["probe"]


def test_no_cap_under_fcfs_or_with_one_class():
    clock = Clock(10.0)
    for sched in (make(1000, fair=False, clock=clock, budget=256),
                  make(1000, clock=clock, budget=256)):
        first = make_seq(600, cls="standard", tenant="A", arrival=10.0, rid="a")
        sched.add(first)
        run_step(sched)
        sched.add(make_seq(20, cls="standard", tenant="B", arrival=10.0, rid="b"))
        out = run_step(sched)  # one class: nobody is below anybody
        assert sum(i.num_new_tokens for i in out.scheduled) == 256


def test_an_aged_request_is_not_capped():
    """A batch request aged to the top level competes as a top-level one."""
    clock = Clock(0.0)
    sched = Scheduler(BlockManager(1000, 4), max_num_seqs=8, max_num_batched_tokens=256,
                      enable_chunked_prefill=True, watermark=0.0,
                      policy=FairPolicy(aging_seconds=10), clock=clock)
    old = make_seq(300, cls="batch", tenant="A", arrival=0.0, rid="old")
    sched.add(old)
    clock.t = 25.0  # waited 2.5 x aging: level 0
    sched.add(make_seq(8, cls="interactive", tenant="B", arrival=25.0, rid="i"))
    out = run_step(sched)  # same level, earlier arrival: old goes first, uncapped
    assert {i.seq.request.request_id: i.num_new_tokens for i in out.scheduled} == {"old": 256}


# --- the engine on the tiny model ------------------------------------------------------------
@pytest.fixture(scope="module")
def engine_for(tiny_llama):
    from llmctl.serve.engine.llm_engine import LLMEngine

    def build(**kwargs):
        kwargs.setdefault("kv_cache_memory", "16MiB")
        return LLMEngine.from_args(str(tiny_llama), **kwargs)

    return build


def first_output_steps(engine, ids, steps):
    """{request id: index of the step that gave its first token}, over ``steps`` steps."""
    seen: dict[str, int] = {}
    for step in range(steps):
        for out in engine.step():
            seen.setdefault(out.request_id, step)
    return {rid: seen.get(rid) for rid in ids}


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_light_tenant_is_not_queued_behind_a_flood(engine_for, policy):
    engine = engine_for(scheduling_policy=policy, max_num_seqs=4)
    params = SamplingParams(max_tokens=8, **GREEDY)
    for i in range(40):
        engine.add_request(f"a{i}", [5 + i % 20] * 12, params, tenant="A")
    for i in range(2):
        engine.add_request(f"b{i}", [7] * 12, params, tenant="B")
    first = first_output_steps(engine, ["b0", "b1"], steps=6)
    if policy == "fair":
        # tenants alternate from equal counters: a0, b0, a1, b1 fill the four slots
        assert first == {"b0": 0, "b1": 0}
    else:  # first come, first served: behind ten waves of A's four
        assert first == {"b0": None, "b1": None}


def test_a_batch_request_runs_within_the_aging_bound_under_an_interactive_flood(engine_for):
    """Two slots; an interactive request (3 tokens, 3 steps) arrives every second while
    four already wait, so interactive work always waits. The batch request (aging bound
    2 x 10 s = 20 s) must not run before 20 s, and then wait at most for a slot: a slot
    frees within 3 steps; displaced once by an interactive arrival, it waits for one more,
    then runs its 4 tokens unhindered."""
    engine = engine_for(scheduling_policy="fair", aging_seconds=10.0, max_num_seqs=2)
    clock = Clock()
    engine.scheduler.clock = clock
    inter = SamplingParams(max_tokens=3, **GREEDY)
    for i in range(4):
        engine.add_request(f"i-{i}", [9, 10, 11], inter, arrival_time=0.0, tenant="Y",
                           priority_class="interactive")
    engine.add_request("batch", [12, 13, 14], SamplingParams(max_tokens=4, **GREEDY),
                       arrival_time=0.0, tenant="X", priority_class="batch")
    first = done = None
    for t in range(60):
        clock.t = float(t)
        engine.add_request(f"i{t}", [9, 10, 11], inter, arrival_time=clock.t, tenant="Y",
                           priority_class="interactive")
        for out in engine.step():
            if out.request_id == "batch":
                first = t if first is None else first
                if out.finished:
                    done = t
        if done is not None:
            break
    assert 20 <= first <= 23
    assert done is not None and done <= 20 + 3 + 3 + 4
    assert engine.scheduler.num_preemptions <= 1


def test_preempting_a_batch_sequence_for_an_interactive_one_loses_no_token(engine_for):
    params = SamplingParams(max_tokens=8, **GREEDY)
    prompts = {f"b{i}": [3 + i] * 20 for i in range(3)}
    reference = engine_for()
    for rid, prompt in prompts.items():
        reference.add_request(rid, prompt, params)
    reference.add_request("urgent", [30] * 20, params)
    expected = {}
    while reference.has_unfinished_requests():
        expected.update({o.request_id: o.outputs[0].token_ids for o in reference.step()
                         if o.finished})

    # 6 blocks of 16: three batch requests (20 prompt + 8 tokens: 2 blocks each) fill them
    engine = engine_for(scheduling_policy="fair", num_kv_blocks=6, block_size=16,
                        max_model_len=64)
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params, tenant="A", priority_class="batch")
    engine.step()
    engine.add_request("urgent", [30] * 20, params, tenant="B", priority_class="interactive")
    outs = engine.step()
    assert "urgent" in {o.request_id for o in outs}  # it got its first token at once
    assert engine.stats().num_preemptions == 1
    got = {}
    while engine.has_unfinished_requests():
        got.update({o.request_id: o.outputs[0].token_ids for o in engine.step()
                    if o.finished})
    assert got == expected


# --- deadline admission ------------------------------------------------------------------
def test_queued_work_counts_what_waits_and_what_was_just_added_by_class(engine_for):
    engine = engine_for(scheduling_policy="fair", max_num_seqs=1)
    params = SamplingParams(max_tokens=10, **GREEDY)
    for rid in ("s0", "s1"):
        engine.add_request(rid, [5] * 20, params, priority_class="standard")
    engine.add_request("b", [5] * 30, params, priority_class="batch")
    # not taken in yet: prompt + max_tokens each (no request finished: fraction 1)
    assert engine.stats().queued_work == [((1,), 60.0), ((2,), 40.0)]
    engine.step()  # s0 runs (one slot): s1 and b wait
    assert engine.stats().queued_work == [((1,), 30.0), ((2,), 40.0)]
    assert engine.admission_key(0, "interactive") == (0,)


def held_engine(engine):
    """Hold the engine thread before each step until released: what is submitted stays
    queued, so the admission arithmetic below is exact rather than a race."""
    release = threading.Event()
    real = engine.step

    def step():
        release.wait(60)
        return real()

    engine.step = step
    return release


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_deadline_admission_refuses_what_the_queue_ahead_makes_late(engine_for, policy):
    from llmctl.serve.engine.async_engine import AsyncEngine, DeadlineError

    engine = engine_for(scheduling_policy=policy)
    for _ in range(8):  # measured: 1000 tokens/s, 10 ms per step, in saturated steps
        engine.rate_meter.record_step(10, 0.01, saturated=True)
    release = held_engine(engine)
    front = AsyncEngine(engine, request_timeout=2.0)
    front.start()
    params = SamplingParams(max_tokens=100, **GREEDY)
    prompt = [5] * 100  # 100 + 100 = 200 tokens of work; its own run: 0.1 + 100 x 0.01 s

    async def submit_all():
        accepted, refusal = [], None
        for i in range(8):
            try:
                front.submit(f"r{i}", prompt, params, tenant="A", priority_class="standard")
                accepted.append(i)
            except DeadlineError as exc:
                refusal = exc
                break
        try:
            front.submit("urgent", prompt, params, tenant="B", priority_class="interactive")
            urgent = "accepted"
        except DeadlineError:
            urgent = "refused"
        finally:  # while this loop still runs: the engine's last deliveries land in it
            release.set()
            front.shutdown()
        return accepted, refusal, urgent

    accepted, refusal, urgent = asyncio.run(submit_all())
    # r_k waits for k x 200 tokens (0.2 s each) + runs 1.1 s: within 2 s while k <= 4
    assert accepted == [0, 1, 2, 3, 4]
    assert refusal is not None and "1000 tokens are queued ahead" in str(refusal)
    assert refusal.retry_after == 1  # ceil(1.0 + 1.1 - 2.0)
    # fair: interactive work goes before the standard queue, so nothing is ahead of it
    assert urgent == ("accepted" if policy == "fair" else "refused")


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_deadline_admission_counts_a_lower_class_wait_only_up_to_its_aging_bound(
        engine_for, policy):
    """A batch request behind a standard queue: under fair, aging schedules it within
    2 x aging_seconds whatever is queued, so the queue ahead counts only up to that (a
    flood above it no longer gets the batch class refused); fcfs has no such bound."""
    from llmctl.serve.engine.async_engine import AsyncEngine, DeadlineError

    engine = engine_for(scheduling_policy=policy, aging_seconds=0.25)
    for _ in range(8):  # measured: 1000 tokens/s, 10 ms per step, in saturated steps
        engine.rate_meter.record_step(10, 0.01, saturated=True)
    release = held_engine(engine)
    front = AsyncEngine(engine, request_timeout=2.0)
    front.start()
    params = SamplingParams(max_tokens=100, **GREEDY)
    prompt = [5] * 100  # 200 tokens of work each; its own run: 0.1 + 100 x 0.01 s

    def outcome(request_id: str, priority_class: str) -> str:
        try:
            front.submit(request_id, prompt, params, tenant="C", priority_class=priority_class)
            return "accepted"
        except DeadlineError as exc:
            return str(exc)

    async def submit_all():
        try:
            for i in range(5):  # 1000 tokens queued: 1 s at the measured rate
                front.submit(f"r{i}", prompt, params, tenant="A", priority_class="standard")
            return outcome("probe", "batch"), outcome("late", "standard")
        finally:
            release.set()
            front.shutdown()

    probe, late = asyncio.run(submit_all())
    if policy == "fair":  # wait min(1.0, 2 x 0.25 + 0) + run 1.1 = 1.6 s <= 2 s
        assert probe == "accepted"
    else:  # wait 1.0 + run 1.1 = 2.1 s > 2 s
        assert "1000 tokens are queued ahead" in probe
    # its own class's queue is not aged past: min(1.0, 0.25 + 1.0) + 1.1 > 2 s
    assert "1000 tokens are queued ahead" in late


def test_without_a_measured_rate_nothing_is_refused(engine_for):
    from llmctl.serve.engine.async_engine import AsyncEngine

    engine = engine_for()
    release = held_engine(engine)
    front = AsyncEngine(engine, request_timeout=0.5)
    front.start()

    async def submit_all():
        try:
            for i in range(20):
                front.submit(f"r{i}", [5] * 100, SamplingParams(max_tokens=100, **GREEDY))
        finally:
            release.set()
            front.shutdown()

    asyncio.run(submit_all())  # raises on any refusal


def test_a_refusal_is_a_503_with_retry_after_and_the_reason(tiny_llama):
    import httpx

    from llmctl.serve.engine.async_engine import DeadlineError
    from tests.serve.api.conftest import start_server

    def refuse(*args, **kwargs):
        raise DeadlineError("cannot finish before its deadline: 900 tokens are queued ahead", 3)

    running = start_server(str(tiny_llama), request_timeout=5.0)
    running.engine._admit = refuse  # the arithmetic is tested above; here, the HTTP answer
    try:
        resp = httpx.post(running.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "x", "max_tokens": 4}, timeout=60)
    finally:
        running.stop()
    assert resp.status_code == 503 and resp.headers["retry-after"] == "3"
    error = resp.json()["error"]
    assert error["code"] == "deadline_unmeetable" and error["type"] == "server_error"
    assert error["message"].startswith("the request cannot finish before its deadline: 900")
