"""Scheduling policy on synthetic sequences (no model): budget, chunks, preemption, order."""

from __future__ import annotations

import pytest

from llmctl.serve.core.block_manager import BlockManager
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.scheduler import Scheduler
from llmctl.serve.core.sequence import Request, SequenceStateError, SequenceStatus


def make_seq(n_tokens, priority=0, arrival=0.0, rid="r"):
    req = Request(rid, list(range(1, n_tokens + 1)), SamplingParams(), prompt=None,
                  priority=priority, arrival_time=arrival, eos_token_ids=frozenset())
    return req.seqs[0]


def make(num_blocks=64, block_size=4, budget=32, max_seqs=8, chunked=True):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                     enable_chunked_prefill=chunked, watermark=0.0)


def run_step(sched):
    """Schedule, then pretend the model ran: advance computed tokens, append a token."""
    out = sched.schedule()
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)
    return out


def test_token_budget_and_chunked_prefill():
    sched = make(budget=10)
    a, b = make_seq(25, arrival=0), make_seq(6, arrival=1)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 10)]
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 10)]
    out = run_step(sched)  # a's last 5 tokens, then b's first 5
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 5), (b, 5)]
    out = run_step(sched)  # a decodes while b finishes its prompt
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 1)]


def test_without_chunking_a_prompt_waits_for_a_whole_step():
    sched = make(budget=10, chunked=False)
    a, b = make_seq(8, arrival=0), make_seq(6, arrival=1)
    sched.add(a)
    sched.add(b)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == [a]  # b (6) does not fit in the 2 left
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 6)]


def test_max_num_seqs():
    sched = make(max_seqs=2)
    seqs = [make_seq(3, arrival=i) for i in range(4)]
    for s in seqs:
        sched.add(s)
    out = run_step(sched)
    assert [s.seq for s in out.scheduled] == seqs[:2]
    assert sched.waiting == seqs[2:]


def test_preemption_takes_the_newest_and_keeps_its_tokens():
    # 6 blocks of 4: three 7-token sequences fill them; growing past 8 forces preemption
    sched = make(num_blocks=6, budget=64)
    seqs = [make_seq(7, arrival=i, rid=f"r{i}") for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)
    run_step(sched)  # every sequence now has 8 tokens, 7 computed
    out = run_step(sched)  # the 9th token needs a third block each: no room for r2
    assert out.preempted == [seqs[2]]
    assert seqs[2].status is SequenceStatus.PREEMPTED and seqs[2].block_table == []
    assert seqs[2].num_tokens == 9 and seqs[2].num_computed_tokens == 0
    assert sched.waiting == [seqs[2]]
    assert [s.seq for s in out.scheduled] == seqs[:2]
    sched.block_manager.check_invariants(sched.running)
    # once the others finish it is readmitted and recomputes all it had
    for s in seqs[:2]:
        sched.finish(s, SequenceStatus.FINISHED_LENGTH)
    out = run_step(sched)
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(seqs[2], 9)]
    assert seqs[2].status is SequenceStatus.RUNNING
    assert sched.num_preemptions == 1


def test_the_asking_sequence_preempts_itself_when_it_is_the_newest():
    sched = make(num_blocks=2, budget=64)
    a = make_seq(7, arrival=0)
    sched.add(a)
    run_step(sched)
    run_step(sched)  # 8 tokens in 2 blocks; the 9th needs a 3rd: nobody else to preempt
    out = sched.schedule()
    assert out.preempted == [a] and not out.scheduled


def test_priority_beats_arrival_and_decides_the_victim():
    sched = make(num_blocks=6, budget=64)
    late_urgent = make_seq(7, priority=-1, arrival=5, rid="urgent")
    early = make_seq(7, priority=0, arrival=0, rid="early")
    mid = make_seq(7, priority=0, arrival=1, rid="mid")
    for s in (early, mid, late_urgent):
        sched.add(s)
    assert sched.waiting == [late_urgent, early, mid]
    run_step(sched)
    run_step(sched)
    out = run_step(sched)
    assert out.preempted == [mid]  # lowest rank: normal priority, latest arrival


def test_illegal_transitions_raise():
    seq = make_seq(3)
    with pytest.raises(SequenceStateError, match="WAITING -> PREEMPTED"):
        seq.transition(SequenceStatus.PREEMPTED)
    seq.transition(SequenceStatus.RUNNING)
    seq.transition(SequenceStatus.FINISHED_STOPPED)
    assert seq.finish_reason == "stop"
    with pytest.raises(SequenceStateError):
        seq.transition(SequenceStatus.RUNNING)


def test_spec_tokens_are_cut_to_the_budget():
    sched = make(budget=3)
    a = make_seq(2)
    sched.add(a)
    run_step(sched)  # prompt of 2
    a.spec_token_ids = [5, 6, 7, 8]
    out = sched.schedule()
    assert (out.scheduled[0].num_new_tokens, out.scheduled[0].num_spec_tokens) == (3, 2)
    assert a.spec_token_ids == [5, 6]
