"""BatchedRuntime (llmctl.engines.runtime): the prefill/decode split and the decode
buffer's membership, written once for both backends.

A fake backend whose "cache" is the token history itself checks the bookkeeping
exactly (every row must see precisely its own history); the ONNX and torch-compile
runtimes then run one membership sequence against each sequence computed alone.
"""

from __future__ import annotations

import numpy as np
import pytest

from llmctl.engines.runtime import BatchedRuntime, BatchedState, DecodeBatch
from tests.engines.conftest import PROMPTS

VOCAB = 997


def _row(history: list[int]) -> np.ndarray:
    """Logits that identify a history: a peak at a hash of it, as high as it is long."""
    row = np.zeros(VOCAB, dtype=np.float32)
    row[hash(tuple(history)) % VOCAB] = len(history)
    return row


class ListState(BatchedState):
    __slots__ = ("tokens",)

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] | None = []

    def views(self) -> list[int]:
        rows = self.batch.rows[self.row] if self.batch is not None else self.tokens
        return rows[:self.length]

    def _copy_out(self) -> None:
        self.tokens = list(self.views())

    def _drop_own(self) -> None:
        self.tokens = None


class ListBatch(DecodeBatch):
    def __init__(self, states, rows) -> None:
        super().__init__(states)
        self.rows = rows


class ListRuntime(BatchedRuntime):
    vocab_size = VOCAB
    max_len = 64

    def __init__(self, max_batch_size: int | None = None) -> None:
        self.max_batch_size = max_batch_size
        self._batch = None
        self.calls: list[tuple[str, int]] = []

    def new_state(self) -> ListState:
        return ListState()

    def _prefill(self, state, chunk, all_logits):
        assert state.batch is None, "a prefill must run on a sequence that owns its cache"
        self.calls.append(("prefill", len(chunk)))
        start = state.length
        state.tokens = list(state.views()) + list(chunk)
        state.length = len(state.tokens)
        rows = [_row(state.tokens[:n]) for n in range(start + 1, state.length + 1)]
        return np.stack(rows) if all_logits else rows[-1]

    def _gather(self, states):
        self.calls.append(("gather", len(states)))
        return ListBatch(states, [list(s.views()) for s in states])

    def _decode(self, batch, states, tokens):
        self.calls.append(("decode", len(states)))
        out = []
        for row, (state, token) in enumerate(zip(states, tokens)):
            assert state.batch is batch and state.row == row
            cache = batch.rows[row]
            del cache[state.length:]  # entries past the length (rejected drafts) are stale
            cache.append(token)
            state.length += 1
            out.append(_row(cache))
        return np.stack(out)


class Checked:
    """Runs forward and checks each returned row against the sequence's own history."""

    def __init__(self, rt: ListRuntime) -> None:
        self.rt = rt
        self.history: dict[int, list[int]] = {}
        self.seen: list[ListState] = []

    def __call__(self, states, chunks, all_logits=False):
        rows = self.rt.forward(states, chunks, all_logits)
        self.seen += [s for s in states if all(s is not t for t in self.seen)]
        # a replaced decode buffer is not kept alive by a sequence that left it
        assert all(s.batch is None or s.batch is self.rt._batch for s in self.seen)
        for state, chunk, got in zip(states, chunks, rows):
            history = self.history.setdefault(id(state), [])
            del history[state.length - len(chunk):]  # what a rollback dropped
            start = len(history)
            history.extend(chunk)
            want = [_row(history[:n]) for n in range(start + 1, len(history) + 1)]
            np.testing.assert_array_equal(got, np.stack(want) if all_logits else want[-1])
        return rows


def test_sequences_join_leave_and_reorder_and_each_sees_only_its_own_cache():
    rt = ListRuntime()
    run = Checked(rt)
    a, b, c = (rt.new_state() for _ in range(3))
    run([a], [[1, 2, 3]])
    run([a], [[4]])
    run([b], [[5, 6]])                         # joins between decode steps
    run([a, b], [[7], [8]])
    run([a, b], [[9], [10]])                    # same group: the buffer is kept
    run([c, a], [[11, 12, 13], [14]])           # a prefill and a decode in one call
    run([c, b, a], [[15], [16], [17]])          # reordered: a new buffer
    run([c, b], [[18], [19]])                   # a left: it owns a copy of its rows again
    run([a], [[20]], all_logits=True)
    assert rt.calls.count(("gather", 2)) == 2 and rt.calls.count(("gather", 3)) == 1


def test_a_prefill_of_a_batched_sequence_takes_its_rows_back_first():
    rt = ListRuntime()
    run = Checked(rt)
    a, b = rt.new_state(), rt.new_state()
    run([a, b], [[1, 2], [3]])
    run([a, b], [[4], [5]])
    run([a], [[6, 7, 8]], all_logits=True)      # a speculative verify chunk
    a.length -= 2                               # two draft tokens rejected
    run([a, b], [[9], [10]])
    assert a.batch is b.batch is not None


def test_decodes_run_in_groups_of_at_most_max_batch_size():
    rt = ListRuntime(max_batch_size=2)
    run = Checked(rt)
    states = [rt.new_state() for _ in range(5)]
    run(states, [[i, i + 1] for i in range(5)])
    rt.calls.clear()
    run(states, [[i] for i in range(5)])
    assert [n for kind, n in rt.calls if kind == "decode"] == [2, 2, 1]


@pytest.fixture(params=["onnx_fp32", "torch_compiled"])
def engine_path(request):
    return request.getfixturevalue(request.param)


def test_continuous_batching_matches_sequences_run_alone(engine_path):
    """Sequences join and leave the decode batch at different steps (in groups of at
    most two); every logit row equals the row computed for that sequence alone."""
    from llmctl.engines.engine_dir import open_engine

    engine = open_engine(engine_path, threads=1, max_batch_size=2)
    rt = engine.runtime
    alone = [engine.logits(p + [60, 61, 62, 63, 64, 65]) for p in PROMPTS]
    states = [rt.new_state() for _ in PROMPTS]
    got = {0: [], 1: [], 2: []}
    got[0].append(rt.forward([states[0]], [PROMPTS[0]])[0])
    got[0].append(rt.forward([states[0]], [[60]])[0])
    got[1].append(rt.forward([states[1]], [PROMPTS[1]])[0])  # joins between decode steps
    for step, tok in enumerate([61, 62]):
        rows = rt.forward([states[0], states[1]], [[tok], [60 + step]])
        got[0].append(rows[0])
        got[1].append(rows[1])
    got[2].append(rt.forward([states[2]], [PROMPTS[2]])[0])
    rows = rt.forward([states[2], states[1], states[0]], [[60], [62], [63]])  # reordered
    got[2].append(rows[0]); got[1].append(rows[1]); got[0].append(rows[2])
    rows = rt.forward([states[2], states[1]], [[61], [63]])  # sequence 0 left
    got[2].append(rows[0]); got[1].append(rows[1])
    for i, rows in got.items():
        n = len(PROMPTS[i])
        want = alone[i][n - 1:n - 1 + len(rows)]
        np.testing.assert_allclose(np.stack(rows), want, atol=1e-4)
