"""Sliding-window models on the paged engine: greedy tokens equal transformers ``generate``
(float32, exact) far past the window, under every scheduling regime; blocks out of the
window are released so a sequence's memory stays flat; prefix caching hits only where
the blocks a window needs are held; configs are read as transformers reads them.

Models: a tiny Mistral with a window of 16 on every layer (head_dim 64, so the AVX-512
kernel paths run), and a tiny Qwen2 with ``use_sliding_window`` and
``max_window_layers=2`` of 4 layers (layers 2 and 3 windowed to 24, 0 and 1 full). Both
are built without an EOS id, so ``generate`` and the engine (``ignore_eos``) both run
the whole ``max_tokens``: every comparison covers hundreds of tokens past the window.
"""

from __future__ import annotations

import math

import pytest

from llmctl.errors import UnsupportedArchitectureError
from llmctl.serve.core.block_manager import DROPPED, BlockManager
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.core.sequence import Request
from llmctl.serve.engine.llm import LLM
from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.model.decoder import ModelSpec
from tests.serve.conftest import assert_all_blocks_free, encode, hf_greedy

LONG_TEXT = ("Lambda expressions (sometimes called lambda forms) are used to create anonymous "
             "functions. The expression lambda parameters: expression yields a function "
             "object. The unnamed object behaves like a function object defined with def.")
# shorter than both windows, about one window, several windows
PROMPTS = ["x", "In Python, a class is a blueprint for objects and", LONG_TEXT]
# every comparison with transformers runs these prompts this far (its results are memoised)
MAX_TOKENS = 200


def _greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tiny_variants):
    return tiny_variants("mistral-w16", model_type="mistral", sliding_window=16,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                         eos_token_id=None, seed=3)


@pytest.fixture(scope="module")
def qwen2(tiny_variants):
    return tiny_variants("qwen2-w24", model_type="qwen2", layers=4, use_sliding_window=True,
                         sliding_window=24, max_window_layers=2, eos_token_id=None, seed=4)


@pytest.fixture(params=["mistral", "qwen2"])
def windowed(request):
    return request.getfixturevalue(request.param)


def _check(path, llm: LLM, prompts=PROMPTS) -> list:
    ids = [encode(path, p) for p in prompts]
    outs = llm.generate(ids, _greedy(MAX_TOKENS))
    for prompt_ids, out in zip(ids, outs):
        got = out.outputs[0].token_ids
        assert len(got) == MAX_TOKENS
        assert got == hf_greedy(path, prompt_ids, MAX_TOKENS), (len(prompt_ids), out.request_id)
    assert_all_blocks_free(llm.engine)
    return outs


# --- configs, read as transformers reads them ---------------------------------------------
def _hf_windows(model_type: str, **config) -> tuple[int | None, ...]:
    """The window each layer of a transformers model built from ``config`` applies."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type, **config)
    if model_type == "mistral":  # MistralModel masks every layer with config.sliding_window
        return (cfg.sliding_window,) * cfg.num_hidden_layers
    # Qwen2Attention.sliding_window: config.sliding_window on "sliding_attention" layers
    return tuple(cfg.sliding_window if t == "sliding_attention" else None
                 for t in cfg.layer_types)


BASE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 6,
        "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.mark.parametrize("model_type,extra", [
    ("mistral", {"sliding_window": 4096}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 4}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}),
    ("qwen2", {"use_sliding_window": False, "sliding_window": 32, "max_window_layers": 2}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 32}),  # default: 28 -> none
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "layer_types": [
        "sliding_attention", "full_attention"] * 3}),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 3}),
])
def test_layer_windows_are_the_ones_transformers_applies(model_type, extra):
    from transformers import AutoConfig

    # the config.json transformers writes (layer_types included), and the bare keys
    saved = AutoConfig.for_model(model_type, **BASE, **extra).to_dict()
    bare = {"model_type": model_type, **BASE, **extra}
    want = _hf_windows(model_type, **BASE, **extra)
    for config in (bare, saved):
        spec = ModelSpec.from_config(config)
        assert spec.layer_windows == want
    windows = [w for w in want if w is not None]
    assert spec.kv_window == (max(windows) if len(windows) == len(want) else None)
    assert spec.window_free_len == (min(windows) if windows else None)
    # the context is the model's, not capped at the window
    assert spec.max_position_embeddings == saved["max_position_embeddings"]


def test_configs_the_engine_cannot_honour_are_refused(tmp_path):
    config = {"model_type": "qwen2", **BASE, "use_sliding_window": True, "sliding_window": 8,
              "layer_types": ["chunked_attention"] * 6}
    with pytest.raises(UnsupportedArchitectureError, match="chunked_attention"):
        ModelSpec.from_config(config)
    with pytest.raises(UnsupportedArchitectureError, match="sliding_window"):
        ModelSpec.from_config({"model_type": "mistral", **BASE, "sliding_window": 0})


# --- the engine against transformers --------------------------------------------------------
def test_greedy_equals_transformers_far_past_the_window(windowed):
    """A batch of prompts shorter than, about and several times the window; 200 tokens."""
    llm = LLM(str(windowed), kv_cache_memory="8MiB")
    _check(windowed, llm)


@pytest.mark.parametrize("budget", [7, 40])
def test_chunked_prefill_with_windows(windowed, budget):
    """7: prompt chunks on cached context through the native kernel; 40: through the
    gathered path with window masks (and its gather starting after dropped blocks)."""
    llm = LLM(str(windowed), kv_cache_memory="8MiB", max_num_batched_tokens=budget)
    _check(windowed, llm, PROMPTS[1:])
    assert llm.engine.stats().num_steps > MAX_TOKENS


def test_preemption_by_recompute_with_windows(mistral):
    """A pool too small for the batch: sequences are preempted and recomputed."""
    llm = LLM(str(mistral), num_kv_blocks=20, max_model_len=320)
    _check(mistral, llm, PROMPTS * 6)
    assert llm.engine.stats().num_preemptions > 0


def test_speculation_and_forks_with_windows(mistral):
    """n-gram drafts verified through the windowed kernel (q_len 1 + k), and the n = 2
    completions of one prompt sharing its blocks (dropped entries included)."""
    llm = LLM(str(mistral), kv_cache_memory="8MiB",
              speculative={"method": "ngram", "num_speculative_tokens": 3})
    _check(mistral, llm, PROMPTS[1:])
    assert llm.engine.stats().spec_accepted_tokens > 0
    ids = encode(mistral, LONG_TEXT)
    out = LLM(str(mistral), kv_cache_memory="8MiB").generate(
        [ids], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, n=2, ignore_eos=True))[0]
    want = hf_greedy(mistral, ids, MAX_TOKENS)
    assert [c.token_ids for c in out.outputs] == [want, want]


def test_memory_held_by_a_sequence_stays_flat(mistral):
    """Window 16, blocks of 16: a sequence releases blocks when it is next scheduled, so
    after its prefill step it still holds its prompt's blocks, and from its first decode
    on it holds the block of its new token and the one its window reaches back into,
    ceil((W - 1) / block_size) + 1 = 2 blocks, for 400 tokens (without release it would
    grow to ceil((prompt + 400) / 16), about 28); the pool's used blocks likewise."""
    llm = LLM(str(mistral), kv_cache_memory="8MiB", block_size=16)
    engine = llm.engine
    bm = engine.block_manager
    assert bm.sliding_window == 16
    ids = encode(mistral, LONG_TEXT)
    engine.add_request("long", ids, _greedy(400))
    held, used, tokens = [], [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        request = engine.requests.get("long")
        if request is not None and not request.seqs[0].in_prefill:
            held.append(len(bm.held_blocks(request.seqs[0])))
            used.append(bm.num_blocks - bm.num_free_blocks)
    bound = math.ceil((16 - 1) / 16) + 1
    assert held[0] == used[0] == math.ceil(len(ids) / 16)  # the prompt's
    assert len(held) == 400 - 1 and max(held[1:]) == bound and max(used[1:]) == bound
    # greedy: the first 200 tokens are those of a 200-token generation
    assert len(tokens) == 400 and tokens[:MAX_TOKENS] == hf_greedy(mistral, ids, MAX_TOKENS)
    assert_all_blocks_free(engine)


# --- prefix caching ---------------------------------------------------------------------------
def test_prefix_cache_hit_with_a_prefix_longer_than_the_window(windowed):
    """Two requests sharing 70 tokens, one after the other: the second takes a cached
    prefix (only its last block is held for Mistral's window of 16) and produces the
    tokens of transformers and of an engine without prefix caching."""
    shared = (LONG_TEXT + " " + LONG_TEXT)
    ids = encode(windowed, shared)[:70]
    a, b = ids + encode(windowed, " first"), ids + encode(windowed, " second one")
    plain = LLM(str(windowed), kv_cache_memory="8MiB", enable_prefix_caching=False)
    cached = LLM(str(windowed), kv_cache_memory="8MiB")
    params = _greedy(60)
    want = [plain.generate([p], params)[0].outputs[0].token_ids for p in (a, b)]
    first = cached.generate([a], params)[0]
    second = cached.generate([b], params)[0]
    assert second.metrics.num_cached_tokens == 64  # 4 full blocks of the 70 shared tokens
    assert [first.outputs[0].token_ids, second.outputs[0].token_ids] == want
    assert want == [hf_greedy(windowed, p, 60) for p in (a, b)]
    assert_all_blocks_free(cached.engine)


def _seq(tokens: list[int]):
    req = Request("r", tokens, SamplingParams(), prompt=None, priority=0, arrival_time=0.0,
                  eos_token_ids=frozenset())
    return req.seqs[0]


def _run(bm: BlockManager, seq, decode_to: int) -> None:
    """Admit ``seq`` whole (taking its cached prefix), then decode token by token."""
    cached = bm.find_cached_prefix(seq)
    assert bm.allocate(seq, seq.num_tokens - len(cached) * bm.block_size, cached) is not None
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    while seq.num_tokens < decode_to:
        seq.token_ids.append(1000 + seq.num_tokens)
        assert bm.allocate(seq, 1) is not None
        seq.num_computed_tokens += 1
        bm.commit(seq)


def test_block_release_and_the_windowed_prefix_rule():
    """Block size 4, window 10: a cached prefix of k blocks needs its last
    ceil((10 - 1) / 4) = 3 blocks held; earlier ones may be gone (DROPPED)."""
    bm = BlockManager(64, 4, sliding_window=10)
    assert bm.window_blocks == 3
    a = _seq(list(range(40)))
    _run(bm, a, decode_to=60)
    # decode at position c reads keys c - 9 .. c: blocks before (c - 9) // 4 are released
    c = a.num_computed_tokens
    assert a.block_table[:(c - 9) // 4] == [DROPPED] * ((c - 9) // 4)
    assert DROPPED not in a.block_table[(c - 9) // 4:]
    bm.check_invariants([a])
    bm.free_seq(a)
    bm.check_invariants([])

    # the prompt's 10 blocks were registered before they were released: a request with
    # the same 40 tokens and 3 more takes all 10, holding only the last 3
    b = _seq(list(range(40)) + [7, 7, 7])
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 10 and hit[:7] == [DROPPED] * 7 and DROPPED not in hit[7:]

    def evict(*indices: int) -> None:  # prompt blocks, as _take_free evicts them
        for i in indices:
            chunk = tuple(range(4 * i, 4 * i + 4))
            del bm.cached[next(h for h, blk in bm.cached.items()
                               if bm.blocks[blk].token_ids == chunk)]

    # block 9 gone: the longest prefix with its last 3 blocks held is blocks 0..8
    evict(9)
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 9 and hit[:6] == [DROPPED] * 6 and DROPPED not in hit[6:]
    # a hole in those 3 (blocks 6, 7): 3 held blocks end at block 5
    evict(6, 7)
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 6 and hit[:3] == [DROPPED] * 3 and DROPPED not in hit[3:]
    # only 0, 1, 4, 8 left: no 3 in a row; 0..1 from the start are a valid prefix of 8
    # tokens (the query at 8 reaches back to key -1)
    evict(2, 3, 5)
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 2 and DROPPED not in hit

    # the cached prefix is taken; decoding on, the chain of hashes goes on from it
    _run(bm, b, decode_to=70)
    bm.check_invariants([b])
    c = _seq(list(range(40)) + [7, 7, 7] + [1000 + i for i in range(43, 70)])
    hit = bm.find_cached_prefix(c)
    assert len(hit) == (c.num_tokens - 1) // 4 and hit[-1] == b.block_table[len(hit) - 1]


def test_full_attention_layers_keep_every_block(qwen2):
    """Qwen2 with full layers 0 and 1: nothing is released, whatever the windows."""
    llm = LLM(str(qwen2), kv_cache_memory="8MiB")
    assert llm.engine.block_manager.sliding_window is None
    assert llm.engine.spec.layer_windows == (None, None, 24, 24)


# --- the fused bf16 decode layers --------------------------------------------------------------
def test_fused_bf16_decode_layers_honour_the_window(mistral, monkeypatch):
    """csrc/decode_layer.cpp gets each layer's window: its decode steps give the very
    log-probs of the layer-by-layer path (whose kernel honours the window, see
    test_sliding_window_kernels.py), 100 tokens past a window of 16."""
    from llmctl.serve.layers import decode_layers

    if cpu_kernels.decode_layer_kernel() is None:
        pytest.skip("this build has no matrix kernel for the fused layers (AVX2 + FMA)")
    # no prefix caching: the second run's prompts would start from cached blocks, whose
    # prefill takes another path (paged attention over the cache, not SDPA's fresh one)
    llm = LLM(str(mistral), dtype="bfloat16", kv_cache_memory="16MiB", bf16_gemm="own",
              enable_prefix_caching=False)
    net = llm.engine.target.model
    if net.decode_layers is None:  # e.g. AVX-512 without BF16: oneDNN's bf16, no own form
        assert cpu_kernels.native_variant() not in ("avx512-bf16", "avx2")
        pytest.skip("no fused form for bf16 weights on this CPU's native build")
    assert net.decode_layers._windows == [16, 16]
    calls = []
    real = decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    params = SamplingParams(temperature=0, max_tokens=100, logprobs=2, ignore_eos=True)
    prompts = [encode(mistral, p) for p in PROMPTS]
    fused = llm.generate(prompts, params)
    assert len(calls) >= 99
    net.decode_layers = None
    plain = llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
