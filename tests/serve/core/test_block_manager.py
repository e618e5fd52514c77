"""Block manager invariants: ownership, freeing, prefix hits only on identical prefixes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmctl.serve.core.block_manager import BlockManager
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.sequence import Request


def make_seq(tokens, n=1):
    req = Request("r", tokens, SamplingParams(n=n), prompt=None, priority=0, arrival_time=0.0,
                  eos_token_ids=frozenset())
    return req.seqs[0]


def prefill(bm: BlockManager, seq) -> bool:
    """Admit ``seq`` whole (taking its cached prefix) and mark it computed + committed."""
    cached = bm.find_cached_prefix(seq)
    num_new = seq.num_tokens - len(cached) * bm.block_size
    if bm.allocate(seq, num_new, cached) is None:
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    return True


def test_blocks_cover_tokens_and_free_returns_them():
    bm = BlockManager(10, 4)
    seq = make_seq(list(range(10)))
    assert prefill(bm, seq)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    bm.check_invariants([seq])
    bm.free_seq(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == 10 and seq.block_table == []


def test_allocation_failure_changes_nothing():
    bm = BlockManager(3, 4)
    a = make_seq(list(range(8)))
    assert prefill(bm, a)
    b = make_seq(list(range(100, 109)))
    assert bm.allocate(b, 9) is None
    assert b.block_table == [] and bm.num_free_blocks == 1
    bm.check_invariants([a, b])


def test_prefix_hit_on_identical_full_blocks_only():
    bm = BlockManager(20, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert prefill(bm, a)
    same_prefix = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 99, 98])
    assert bm.find_cached_prefix(same_prefix) == a.block_table[:2]
    differs_in_block_two = make_seq([1, 2, 3, 4, 5, 6, 0, 8, 9, 10])
    assert bm.find_cached_prefix(differs_in_block_two) == a.block_table[:1]
    shifted = make_seq([0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.find_cached_prefix(shifted) == []
    # the last token is always computed: an 8-token prompt reuses one block, not two
    exact = make_seq([1, 2, 3, 4, 5, 6, 7, 8])
    assert bm.find_cached_prefix(exact) == a.block_table[:1]


def test_same_block_contents_after_a_different_prefix_is_a_miss():
    bm = BlockManager(20, 4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert prefill(bm, a)
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 0])  # block 2 equal, parent differs
    assert bm.find_cached_prefix(b) == []


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, 4)
    a = make_seq(list(range(9)))  # 3 blocks, 2 full
    assert prefill(bm, a)
    bm.free_seq(a)
    again = make_seq(list(range(9)))
    assert len(bm.find_cached_prefix(again)) == 2
    # a newcomer needing 3 blocks takes the unhashed block first, then the LRU cached one
    other = make_seq(list(range(100, 112)))
    assert prefill(bm, other)
    assert len(bm.find_cached_prefix(make_seq(list(range(9))))) == 1
    bm.check_invariants([other])


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_block():
    bm = BlockManager(10, 4)
    parent = make_seq(list(range(6)), n=2)
    assert prefill(bm, parent)
    child = make_seq(list(range(6)))
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert all(bm.blocks[b].ref_count == 2 for b in parent.block_table)
    parent.token_ids.append(50)
    copies = bm.allocate(parent, 1)
    assert len(copies) == 1
    src, dst = copies[0]
    assert src == child.block_table[1] and dst == parent.block_table[1] and src != dst
    assert parent.block_table[0] == child.block_table[0]
    child.token_ids.append(60)
    assert bm.allocate(child, 1) == []  # now the only owner: written in place
    bm.check_invariants([parent, child])
    bm.free_seq(parent)
    bm.free_seq(child)
    bm.check_invariants([])
    assert bm.num_free_blocks == 10


def test_trim_releases_blocks_of_rejected_drafts():
    bm = BlockManager(10, 4)
    seq = make_seq(list(range(5)))
    assert bm.allocate(seq, 5 + 6) == []
    assert len(seq.block_table) == 3
    bm.trim(seq, 6)
    assert len(seq.block_table) == 2
    bm.check_invariants([seq])


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "fork"]),
                         st.integers(0, 7), st.integers(1, 20)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, caching=st.booleans())
def test_random_workloads_keep_the_books_balanced(ops, caching):
    """No block is owned twice or leaked, whatever the order of operations."""
    bm = BlockManager(24, 4, enable_prefix_caching=caching)
    live = []
    # token streams drawn from a small alphabet so prefixes repeat and the cache gets hits
    for op, a, b in ops:
        if op == "add":
            seq = make_seq([(a * 7 + i) % 5 for i in range(b)])
            if prefill(bm, seq):
                live.append(seq)
        elif op == "grow" and live:
            seq = live[a % len(live)]
            seq.token_ids.extend([a % 5] * (b % 6 + 1))
            if bm.allocate(seq, seq.num_tokens - seq.num_computed_tokens) is not None:
                seq.num_computed_tokens = seq.num_tokens
                bm.commit(seq)
        elif op == "free" and live:
            bm.free_seq(live.pop(a % len(live)))
        elif op == "fork" and live:
            parent = live[a % len(live)]
            child = make_seq(list(parent.token_ids))
            bm.fork(parent, child)
            live.append(child)
        bm.check_invariants(live)
        for seq in live:
            assert len(seq.block_table) == bm.blocks_needed(seq.num_computed_tokens)
            # a cached block's recorded tokens are the tokens this sequence has there
            for i, block_id in enumerate(seq.block_table[:seq.num_computed_tokens // 4]):
                block = bm.blocks[block_id]
                if block.hash is not None:
                    assert list(block.token_ids) == seq.token_ids[i * 4:(i + 1) * 4]
    for seq in live:
        bm.free_seq(seq)
    bm.check_invariants([])
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("caching", [True, False])
def test_hit_rate_counts_reused_tokens(caching):
    bm = BlockManager(20, 4, enable_prefix_caching=caching)
    assert prefill(bm, make_seq(list(range(13))))
    assert prefill(bm, make_seq(list(range(13))))
    assert bm.stats.queried_tokens == 26
    assert bm.stats.hit_tokens == (12 if caching else 0)
