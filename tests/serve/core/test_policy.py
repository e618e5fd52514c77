"""Ordering policies on synthetic sequences (no blocks, no model): classes, aging, fair share."""

from __future__ import annotations

import random

import pytest

from llmctl.serve.core.policy import FairPolicy, FCFSPolicy
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.sequence import Request, SequenceStatus


def make_seq(rid, *, tenant=None, cls=None, arrival=0.0, prompt=10, priority=0):
    req = Request(rid, list(range(1, prompt + 1)), SamplingParams(max_tokens=8), prompt=None,
                  priority=priority, arrival_time=arrival, eos_token_ids=frozenset(),
                  tenant=tenant, priority_class=cls)
    return req.seqs[0]


def queue(policy, seqs):
    for seq in seqs:
        policy.enqueue(seq)
    return list(seqs)


def ids(seqs):
    return [s.request.request_id for s in seqs]


def test_classes_are_strict_and_unknown_or_missing_is_standard():
    policy = FairPolicy(aging_seconds=100)
    waiting = queue(policy, [make_seq("batch", cls="batch", arrival=0),
                             make_seq("std", cls="standard", arrival=1),
                             make_seq("inter", cls="interactive", arrival=2),
                             make_seq("none", arrival=3),
                             make_seq("typo", cls="interactiv", arrival=4)])
    assert ids(policy.order(waiting, now=5)) == ["inter", "std", "none", "typo", "batch"]


def test_priority_orders_a_tenants_own_requests_within_a_class():
    policy = FairPolicy(aging_seconds=100)
    waiting = queue(policy, [make_seq("late-urgent", arrival=5, priority=-1),
                             make_seq("early", arrival=0), make_seq("mid", arrival=1)])
    assert ids(policy.order(waiting, now=6)) == ["late-urgent", "early", "mid"]


def test_aging_lifts_one_class_per_period():
    policy = FairPolicy(aging_seconds=10)
    batch = make_seq("b", cls="batch", arrival=0).request
    assert [policy.level(batch, t) for t in (0, 9.99, 10, 19.99, 20, 1000)] == [2, 2, 1, 1, 0, 0]
    assert policy.aging_bound("batch") == 20 and policy.aging_bound("interactive") == 0
    assert policy.level(batch, -5) == 2  # a clock behind the arrival does not demote


def test_a_batch_request_is_admitted_within_the_aging_bound_under_an_interactive_flood():
    """One admission per second; tenant Y sends two interactive requests a second, more
    than is served, so interactive work always waits. The batch request of tenant X must
    wait while it is below the top class (strict classes), and go soon after its aging
    bound (20 s): at the top level its tenant's counter is the smaller one."""
    policy = FairPolicy(aging_seconds=10)
    waiting = queue(policy, [make_seq("batch", tenant="X", cls="batch", arrival=0)])
    admitted_at = None
    for t in range(60):
        waiting += queue(policy, [make_seq(f"i{t}.{k}", tenant="Y", cls="interactive",
                                           arrival=t) for k in range(2)])
        head = policy.order(waiting, now=t)[0]
        waiting.remove(head)
        policy.dequeue(head)
        head.transition(SequenceStatus.RUNNING)
        policy.charge(head, 0, head.num_tokens)
        if head.request.request_id == "batch":
            admitted_at = t
            break
    assert admitted_at == 20


def test_a_flooding_tenant_does_not_push_a_light_one_to_the_back():
    policy = FairPolicy()
    flood = [make_seq(f"a{i}", tenant="A", arrival=i * 0.01) for i in range(40)]
    light = [make_seq(f"b{i}", tenant="B", arrival=1 + i * 0.01) for i in range(2)]
    waiting = queue(policy, flood + light)
    order = ids(policy.order(waiting, now=2))
    # both counters start at 0 (B is lifted to A's); each pick advances its tenant by its
    # 10-token prompt, and ties go to the earlier head: A, B, A, B, then A's rest
    assert [order.index("b0"), order.index("b1")] == [1, 3]
    assert order[4:] == [f"a{i}" for i in range(2, 40)]
    fcfs = ids(FCFSPolicy().order(sorted(waiting, key=FCFSPolicy().key), now=2))
    assert [fcfs.index("b0"), fcfs.index("b1")] == [40, 41]


def test_an_idle_tenant_banks_no_credit():
    policy = FairPolicy()
    busy = queue(policy, [make_seq(f"a{i}", tenant="A", arrival=i) for i in range(6)])
    for seq in busy[:2]:  # A alone: served 2 x 10 prompt tokens
        policy.dequeue(seq)
        policy.charge(seq, 0, 10)
    assert policy.counters["A"] == 20
    late = queue(policy, [make_seq(f"b{i}", tenant="B", arrival=10 + i) for i in range(4)])
    assert policy.counters["B"] == 20  # lifted to the smallest waiting counter, not 0
    order = ids(policy.order(busy[2:] + late, now=20))
    assert order[:4] == ["a2", "b0", "a3", "b1"]  # alternating, not B's four first


def test_a_tenant_arriving_to_an_empty_queue_starts_at_the_last_one_to_leave():
    policy = FairPolicy()
    (a,) = queue(policy, [make_seq("a", tenant="A")])
    policy.dequeue(a)
    policy.charge(a, 0, 10)
    queue(policy, [make_seq("b", tenant="B", arrival=1)])
    assert policy.counters["B"] == policy.counters["A"] == 10


def test_charges_weigh_output_tokens_twice_divide_by_weight_and_skip_recomputation():
    policy = FairPolicy(weights={"W": 2.0})
    seq = make_seq("w", tenant="W", prompt=8)
    seq.token_ids += [5, 6, 7, 8]  # 8 prompt + 4 output tokens
    policy.charge(seq, 0, 10)  # positions 0-9: 8 prompt (x1) + 2 output (x2) = 12, / 2
    assert policy.counters["W"] == pytest.approx(6.0)
    policy.charge(seq, 0, 11)  # recomputed after a preemption: only position 10 is new
    assert policy.counters["W"] == pytest.approx(7.0)


def test_order_is_deterministic_whatever_the_input_order():
    policy = FairPolicy(aging_seconds=5)
    seqs = queue(policy, [make_seq(f"r{i}", tenant=random.Random(i).choice("ABC"),
                                   cls=random.Random(i + 99).choice(
                                       ["interactive", "standard", "batch", None]),
                                   arrival=i // 3, prompt=1 + i % 7) for i in range(60)])
    first = ids(policy.order(seqs, now=12))
    for seed in range(5):
        shuffled = list(seqs)
        random.Random(seed).shuffle(shuffled)
        assert ids(policy.order(shuffled, now=12)) == first
    assert sorted(first) == sorted(ids(seqs))


def test_preemptible_is_strictly_lower_base_class_newest_first_and_only_once():
    policy = FairPolicy(aging_seconds=100)
    running = sorted([make_seq("std-old", cls="standard", arrival=0),
                      make_seq("batch-old", cls="batch", arrival=0),
                      make_seq("batch-new", cls="batch", arrival=5),
                      make_seq("inter", cls="interactive", arrival=6)], key=policy.key)
    head = make_seq("i2", cls="interactive", arrival=7)
    assert ids(policy.preemptible(head, running, now=7)) == \
        ["batch-new", "batch-old", "std-old"]
    # a batch request waited longer than aging: same counters, so nothing of its own class
    aged = make_seq("b2", cls="batch", arrival=-300)
    assert policy.due(aged.request, 7) and policy.preemptible(aged, running, now=7) == []
    assert ids(policy.preemptible(make_seq("s2", cls="standard"), running, now=7)) == \
        ["batch-new", "batch-old"]
    policy.displaced(running[-1])  # batch-new
    assert ids(policy.preemptible(head, running, now=7)) == ["batch-old", "std-old"]


def test_a_due_request_may_displace_tenants_served_more_than_its_own_below_the_top_class():
    """Aging bound 2 x 10 s for batch. Before it, a batch request displaces nothing; at it,
    any running sequence below the top class of a tenant whose counter is above its own
    tenant's, newest first -- never the interactive class, never a tenant served less,
    never one displaced before."""
    policy = FairPolicy(aging_seconds=10)
    policy.counters.update({"flood": 5000.0, "light": 10.0, "probe": 100.0})
    running = sorted([make_seq("f-old", tenant="flood", cls="standard", arrival=0),
                      make_seq("f-new", tenant="flood", cls="standard", arrival=4),
                      make_seq("light", tenant="light", cls="batch", arrival=1),
                      make_seq("fi", tenant="flood", cls="interactive", arrival=3)],
                     key=policy.key)
    probe = make_seq("probe", tenant="probe", cls="batch", arrival=0)
    assert not policy.due(probe.request, 19.9) and \
        policy.preemptible(probe, running, now=19.9) == []
    assert policy.due(probe.request, 20.0)
    assert ids(policy.preemptible(probe, running, now=20.0)) == ["f-new", "f-old"]
    policy.displaced(next(s for s in running if s.request.request_id == "f-new"))
    assert ids(policy.preemptible(probe, running, now=20.0)) == ["f-old"]
    # the flood's own due request gets nothing from the tenants served less than it
    due_flood = make_seq("f-due", tenant="flood", cls="standard", arrival=0)
    assert policy.preemptible(due_flood, running, now=20.0) == \
        [s for s in reversed(running) if s.request.request_id == "light"]


def test_fcfs_keeps_the_waiting_order_and_never_preempts():
    policy = FCFSPolicy()
    seqs = [make_seq("b", priority=1), make_seq("a", priority=0, arrival=3)]
    assert policy.order(seqs, now=0) == seqs
    assert policy.preemptible(seqs[0], seqs, now=0) == []
    assert policy.key(seqs[1]) < policy.key(seqs[0])


def test_bad_policy_settings_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        FairPolicy(classes=("a", "a"), default_class="a")
    with pytest.raises(ValueError, match="default class"):
        FairPolicy(default_class="gold")
    with pytest.raises(ValueError, match="aging_seconds"):
        FairPolicy(aging_seconds=0)
