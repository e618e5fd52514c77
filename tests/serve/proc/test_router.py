"""Replica routing: least outstanding tokens, prefix affinity within the slack, breakers
and down replicas (loads and boundaries computed by hand in the comments)."""

from __future__ import annotations

import pytest

from llmctl.serve.proc.breaker import BreakerConfig
from llmctl.serve.proc.router import NoReplicaError, Router, RouterConfig

# blocks of 4 tokens, affinity on the first 2 blocks (8 tokens), slack 0.5 of the mean
CONFIG = RouterConfig(block_size=4, affinity_blocks=2, affinity_slack=0.5)
P = list(range(100, 110))  # 10 tokens: keyed by its first 8
P_TOO = list(range(100, 108)) + [7, 7, 7, 7]  # same first 8 tokens, same key
NO_KEY = [1, 2, 3]  # shorter than one block


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def router(n: int = 2, config: RouterConfig = CONFIG, **breaker) -> tuple[Router, Clock]:
    clock = Clock()
    return Router(n, config, BreakerConfig(**breaker), clock), clock


def test_least_outstanding_tokens_wins():
    r, _ = router(3)
    assert r.pick("a", NO_KEY, 100) == 0  # loads 0 0 0: tie, lowest index
    assert r.pick("b", NO_KEY, 50) == 1  # 100 0 0
    assert r.pick("c", NO_KEY, 70) == 2  # 100 50 0
    assert r.pick("d", NO_KEY, 10) == 1  # 100 50 70
    assert r.pick("e", NO_KEY, 1) == 1  # 100 60 70
    assert [r.outstanding(i) for i in range(3)] == [100.0, 61.0, 70.0]
    assert r.requests_on(1) == ["b", "d", "e"]


def test_ties_go_to_the_lowest_index():
    r, _ = router(3)
    for rid in "abc":
        r.pick(rid, NO_KEY, 10)  # one on each: 10 10 10
    assert r.pick("d", NO_KEY, 5) == 0
    r.finished("a", ok=True)  # 0 released: 5 10 10
    r.finished("d", ok=True)  # 0 10 10
    r.finished("c", ok=True)  # 0 10 0: replicas 0 and 2 tie
    assert r.pick("e", NO_KEY, 5) == 0


def test_finished_releases_and_unknown_ids_are_ignored():
    r, _ = router()
    r.pick("a", NO_KEY, 100)
    r.pick("b", NO_KEY, 30)
    r.finished("a", ok=True)
    assert (r.outstanding(0), r.outstanding(1)) == (0.0, 30.0)
    assert r.requests_on(0) == []
    r.finished("a", ok=False)  # twice: ignored, and no failure reaches the breaker
    r.finished("nobody", ok=False)
    assert r.snapshot()[0]["consecutive_failures"] == 0
    assert r.pick("c", NO_KEY, 1) == 0


def test_progress_lowers_outstanding_never_below_zero():
    r, _ = router()
    r.pick("a", NO_KEY, 100)
    r.progress("a", 30)
    assert r.outstanding(0) == 70.0
    r.progress("a", 20)  # cumulative: an older, lower report changes nothing
    assert r.outstanding(0) == 70.0
    r.progress("a", 150)  # generated past its estimate
    assert r.outstanding(0) == 0.0
    r.finished("a", ok=True)
    assert r.outstanding(0) == 0.0
    r.progress("a", 10)  # after it finished: ignored
    assert r.outstanding(0) == 0.0


def loaded_with_affinity() -> Router:
    """P's key on replica 0 with 300 tokens; 100 tokens without a key on replica 1."""
    r, _ = router()
    assert r.pick("a", P, 300) == 0
    assert r.pick("x", NO_KEY, 100) == 1
    return r


def test_affinity_followed_up_to_the_slack_boundary():
    # L_a - min = 300 - 100 = 200; mean = 200, slack * mean = 100: follow iff 200 <= 100 + t
    r = loaded_with_affinity()
    assert r.pick("b", P_TOO, 100) == 0  # t = 100: on the boundary, follows
    r = loaded_with_affinity()
    assert r.pick("b", list(range(200, 210)), 100) == 1  # another prefix: least loaded


def test_affinity_dropped_past_the_slack_boundary_and_remapped():
    r = loaded_with_affinity()
    assert r.pick("b", P_TOO, 99) == 1  # t = 99: 200 > 199, overloaded
    # the key now names replica 1; with 0 idle it is followed while within the slack:
    r.finished("a", ok=True)  # loads 0, 199: L_a - min = 199, mean 99.5 -> 49.75 + t
    assert r.pick("c", P, 150) == 1  # 199 <= 199.75
    r.finished("c", ok=True)
    assert r.pick("d", P, 149) == 0  # 199 > 198.75


@pytest.mark.parametrize("tokens, expected", [(40, 0), (39, 1)])
def test_slack_zero_follows_within_one_requests_tokens(tokens, expected):
    r, _ = router(config=RouterConfig(block_size=4, affinity_blocks=2, affinity_slack=0.0))
    r.pick("a", P, 50)  # 0
    r.pick("x", NO_KEY, 10)  # 1: loads 50, 10; follow iff 50 - 10 <= 0 * 30 + t
    assert r.pick("b", P, tokens) == expected


def test_short_prompts_and_distinct_blocks_have_no_shared_key():
    r, _ = router()
    assert r.affinity_key(NO_KEY) is None
    assert r.affinity_key(list(range(7))) != r.affinity_key(list(range(8)))  # 1 block vs 2
    assert r.affinity_key(P) == r.affinity_key(P_TOO)  # only the first 2 blocks count
    assert r.pick("a", NO_KEY, 10) == 0
    assert r.pick("b", NO_KEY, 10) == 1  # same prompt, no affinity: least loaded
    assert r.pick("c", P[:4] + [0, 0, 0, 0], 1) == 0  # tie
    assert r.pick("d", P[:4] + [1, 1, 1, 1], 100) == 1  # shares one block of two: own key


def test_affinity_disabled_with_zero_blocks():
    r, _ = router(config=RouterConfig(affinity_blocks=0))
    assert r.affinity_key(list(range(1000))) is None


def affinity_after_restart(restart: bool) -> int:
    r, _ = router()
    r.pick("a", P, 10)  # 0
    r.pick("x", NO_KEY, 5)  # 1
    if restart:
        r.set_up(0, False)
        r.set_up(0, True)
    # if P's key still names 0: 10 - 5 = 5 <= 0.5 * 7.5 + 10, followed
    return r.pick("b", P, 10)


def test_a_down_replica_is_skipped_and_its_affinity_forgotten():
    assert affinity_after_restart(restart=False) == 0
    assert affinity_after_restart(restart=True) == 1
    r, _ = router()
    r.pick("a", P, 10)  # 0
    r.set_up(0, False)
    r.finished("a", ok=False)  # the supervisor fails what was on it: 0 is idle
    assert r.snapshot()[0]["up"] is False and r.snapshot()[0]["state"] == "open"
    assert r.pick("b", NO_KEY, 10) == 1
    assert r.pick("c", P, 10) == 1
    r.set_up(0, True)
    assert r.snapshot()[0]["state"] == "closed"
    assert r.pick("d", NO_KEY, 10) == 0


def test_an_ejected_replica_is_skipped_then_gets_exactly_one_probe():
    r, clock = router(open_seconds=5.0)  # threshold 3
    for rid in ("f1", "f2", "f3"):
        assert r.pick(rid, NO_KEY, 10) == 0  # idle pool: replica 0 each time
        r.finished(rid, ok=False)
    assert r.snapshot()[0]["state"] == "open"
    assert r.pick("a", NO_KEY, 10) == 1
    assert r.pick("b", NO_KEY, 10) == 1  # 0 is idle but ejected
    clock.t = 4.9
    assert r.pick("c", NO_KEY, 10) == 1
    clock.t = 5.0  # half-open; loads 0, 30
    assert r.pick("probe", NO_KEY, 10) == 0
    assert r.pick("d", NO_KEY, 10) == 1  # 10 < 40, but the probe is out
    assert r.pick("e", NO_KEY, 10) == 1
    r.finished("probe", ok=True)
    assert r.snapshot()[0]["state"] == "closed"
    assert r.pick("g", NO_KEY, 10) == 0


def test_a_failed_probe_ejects_again_for_twice_as_long():
    r, clock = router(open_seconds=5.0)
    for rid in ("f1", "f2", "f3"):
        r.pick(rid, NO_KEY, 10)
        r.finished(rid, ok=False)
    clock.t = 5.0
    assert r.pick("probe", NO_KEY, 10) == 0
    r.finished("probe", ok=False)  # open over [5, 15)
    clock.t = 14.0
    assert r.pick("a", NO_KEY, 10) == 1
    clock.t = 15.0
    assert r.pick("b", NO_KEY, 1) == 0


def test_when_every_live_replica_is_ejected_they_serve_anyway():
    """Ejection moves load; it never refuses while a replica is up (a client's failing
    requests must not turn the server away from everybody)."""
    r, clock = router(failure_threshold=1, open_seconds=5.0)
    r.pick("a", NO_KEY, 10)  # 0
    r.finished("a", ok=False)  # 0 open over [0, 5)
    clock.t = 2.0
    assert r.pick("b", NO_KEY, 10) == 1
    r.finished("b", ok=False)  # 1 open over [2, 7)
    clock.t = 3.0
    assert [x["state"] for x in r.snapshot()] == ["open", "open"]
    assert r.pick("c", NO_KEY, 30) == 0  # least loaded of the live ones
    assert r.pick("d", NO_KEY, 10) == 1
    r.set_up(0, False)
    assert r.pick("e", NO_KEY, 10) == 1  # the only one up


def test_no_replica_error_carries_retry_after():
    r, clock = router(open_seconds=5.0)
    r.set_up(0, False)  # forced open over [0, 5)
    clock.t = 2.0
    r.set_up(1, False)  # forced open over [2, 7)
    clock.t = 3.0
    with pytest.raises(NoReplicaError) as caught:
        r.pick("c", NO_KEY, 10)
    assert caught.value.retry_after == pytest.approx(2.0)  # replica 0 half-opens at 5
    assert "retry in 2 s" in str(caught.value)
    assert r.requests_on(0) == r.requests_on(1) == []  # nothing recorded


def test_all_down_retry_after_is_at_least_one_second():
    r, clock = router(open_seconds=5.0)
    r.set_up(0, False)
    r.set_up(1, False)
    with pytest.raises(NoReplicaError) as caught:
        r.pick("a", NO_KEY, 10)
    assert caught.value.retry_after == pytest.approx(5.0)
    clock.t = 60.0  # breakers half-open, but the replicas are still down
    with pytest.raises(NoReplicaError) as caught:
        r.pick("a", NO_KEY, 10)
    assert caught.value.retry_after == 1.0


def affinity_after_two_other_keys(max_entries: int, touch_first: bool) -> int:
    config = RouterConfig(block_size=4, affinity_blocks=2, max_affinity_entries=max_entries)
    r, _ = router(config=config)
    key_a, key_b, key_c = ([k] * 8 for k in (1, 2, 3))
    assert r.pick("a", key_a, 10) == 0
    assert r.pick("b", key_b, 10) == 1
    if touch_first:
        assert r.pick("a2", key_a, 0) == 0  # a hit refreshes key_a; key_b is now oldest
    assert r.pick("c", key_c, 10) == 0  # loads 10 10: tie
    # loads 20, 10: key_a on 0 is followed if remembered (10 <= 0.5 * 15 + 10)
    return r.pick("d", key_a, 10)


def test_the_affinity_map_is_a_bounded_lru():
    assert affinity_after_two_other_keys(max_entries=3, touch_first=False) == 0
    assert affinity_after_two_other_keys(max_entries=2, touch_first=False) == 1  # evicted
    assert affinity_after_two_other_keys(max_entries=2, touch_first=True) == 0  # b evicted


def test_snapshot_reports_each_replica():
    r, _ = router(failure_threshold=1)
    r.pick("a", NO_KEY, 10)
    r.pick("b", NO_KEY, 20)
    r.pick("c", NO_KEY, 5)
    r.finished("b", ok=False)
    assert r.snapshot() == [
        {"index": 0, "up": True, "state": "closed", "outstanding": 15.0, "requests": 2,
         "consecutive_failures": 0, "opened_count": 0},
        {"index": 1, "up": True, "state": "open", "outstanding": 0.0, "requests": 0,
         "consecutive_failures": 1, "opened_count": 1},
    ]


def test_misuse_is_refused():
    r, _ = router()
    r.pick("a", NO_KEY, 10)
    with pytest.raises(ValueError, match="already routed"):
        r.pick("a", NO_KEY, 10)
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        r.pick("b", NO_KEY, -1)
    with pytest.raises(ValueError, match="num_replicas"):
        Router(0)


@pytest.mark.parametrize("config, message", [
    ({"block_size": 0}, "block_size"),
    ({"affinity_blocks": -1}, "affinity_blocks"),
    ({"affinity_slack": -0.1}, "affinity_slack"),
    ({"max_affinity_entries": 0}, "max_affinity_entries"),
])
def test_config_rejects_bad_values(config, message):
    with pytest.raises(ValueError, match=message):
        RouterConfig(**config)
