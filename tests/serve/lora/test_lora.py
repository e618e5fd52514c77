"""Multi-LoRA in the engine against PEFT (transformers + peft, float32, unmerged).

One engine serves three random adapters (tests/serve/conftest.py ``tiny_loras``; every
``lora_B`` redrawn, so an adapter that is ignored or misapplied changes the logits by
O(1)). Tolerance 1e-4 absolute on float32 logits of magnitude ~5: the engine folds the
scale into B, stacks the A of fused q/k/v and gate/up and orders the sums differently
from PEFT, which moves results by float32 rounding (~5e-6 measured), not more.
"""

from __future__ import annotations

import functools
import json
import shutil

import pytest
import torch

from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.llm import LLM
from llmctl.serve.lora.adapter import LoRAError, LoRANotFoundError, load_adapter
from llmctl.serve.model.decoder import ModelSpec
from tests.lora_adapters import peft_model

ATOL = 1e-4
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_llama, tiny_loras):
    return LLM(str(tiny_llama), loras={k: str(v) for k, v in tiny_loras.items()},
               kv_cache_memory="32MiB", max_num_seqs=16)


@functools.lru_cache(maxsize=8)
def _reference(model_dir: str, adapter_dir: str | None):
    from pathlib import Path

    return peft_model(Path(model_dir), None if adapter_dir is None else Path(adapter_dir))


def _record_steps(llm, monkeypatch) -> list[list]:
    """Each step's (request id, lora name, logits row) triples."""
    steps: list[list] = []
    real = llm.engine.runner.execute

    def execute(items):
        logits, rows = real(items)
        steps.append([(r.item.seq.request.request_id,
                       getattr(r.item.seq.request.lora, "name", None), logits[r.start].clone())
                      for r in rows])
        return logits, rows

    monkeypatch.setattr(llm.engine.runner, "execute", execute)
    return steps


def test_logits_and_greedy_match_peft_with_adapters_and_base_in_one_batch(
        llm, tiny_llama, tiny_loras, monkeypatch):
    steps = _record_steps(llm, monkeypatch)
    # two prompt lengths: two attention groups in the prefill, each ordered by adapter, so
    # "all4" has rows in both (two segments) and the span from "some8" to "attn1" holds
    # the second group's base and "all4" rows (which its delta must leave alone)
    names = [None, "all4", "some8", None, "attn1", "all4"]
    prompts = ["The file object"] * 3 + ["In Python, a class is"] * 3
    outs = llm.generate(prompts, GREEDY, lora=names)
    # one batch: every step ran all five requests (the prefill and each decode)
    assert len(steps) == GREEDY.max_tokens
    assert all(sorted(map(str, (n for _, n, _ in step))) == sorted(map(str, names))
               for step in steps)
    by_request: dict[str, list[torch.Tensor]] = {}
    for step in steps:
        for rid, _, row in step:
            by_request.setdefault(rid, []).append(row)
    answers = {}
    for out, name in zip(outs, names):
        ref = _reference(str(tiny_llama), None if name is None else str(tiny_loras[name]))
        prompt = out.prompt_token_ids
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            expected = ref(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            greedy = ref.generate(torch.tensor([prompt]), max_new_tokens=len(tokens),
                                  min_new_tokens=len(tokens), do_sample=False)
        got = torch.stack(by_request[out.request_id])
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
        assert tokens == greedy[0, len(prompt):].tolist()
        answers[name, out.prompt] = tuple(tokens)
    # the adapters matter: the same prompt answers differently under each
    assert len({answers[key] for key in answers if key[1] == prompts[0]}) == 3
    assert len({answers[key] for key in answers if key[1] == prompts[3]}) == 3


def test_base_only_steps_build_no_lora_batch(llm, monkeypatch):
    seen = []
    model = llm.engine.runner.model
    real = model.forward

    def forward(*args, **kwargs):
        seen.append(kwargs["lora"])  # the runner passes it by name
        return real(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    llm.generate(["The file object", "x"], SamplingParams(max_tokens=3, temperature=0))
    assert seen and all(lora is None for lora in seen)
    seen.clear()
    llm.generate(["The file object", "x"], SamplingParams(max_tokens=3, temperature=0),
                 lora=[None, "all4"])
    assert seen and all(lora is not None for lora in seen)


def test_prefix_cache_is_keyed_by_adapter(llm):
    # 3 whole blocks of 16 tokens: what a hit can cover
    prompt = list(range(10, 60))
    params = SamplingParams(max_tokens=2, temperature=0)

    def cached(lora):
        return llm.generate([prompt], params, lora=lora)[0].metrics.num_cached_tokens

    assert cached("some8") == 0
    assert cached("attn1") == 0  # same tokens, other adapter: no hit
    assert cached(None) == 0  # nor for the base model
    assert cached("some8") == 48  # the same adapter again: its blocks
    assert cached("attn1") == 48
    assert cached(None) == 48


def test_max_loras_bounds_adapters_per_step(tiny_llama, tiny_loras, monkeypatch):
    llm = LLM(str(tiny_llama), loras={k: str(v) for k, v in tiny_loras.items()},
              kv_cache_memory="16MiB", max_loras=1)
    steps = _record_steps(llm, monkeypatch)
    names = ["all4", "some8", None, "all4"]
    outs = llm.generate(["a b c", "a b c", "a b c", "d e"], GREEDY, lora=names)
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)
    per_step = [{n for _, n, _ in step} - {None} for step in steps]
    assert max(len(s) for s in per_step) == 1
    assert {"all4", "some8"} == set().union(*per_step)


def test_unload_lets_running_requests_finish(tiny_llama, tiny_loras):
    llm = LLM(str(tiny_llama), kv_cache_memory="16MiB")
    llm.add_lora("x", str(tiny_loras["all4"]))
    expected = llm.generate(["The file object"], GREEDY, lora="x")[0].outputs[0].token_ids
    engine = llm.engine
    engine.add_request("r", "The file object", GREEDY, lora="x")
    engine.step()
    engine.remove_lora("x")
    with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'x'"):
        engine.add_request("r2", "The file object", GREEDY, lora="x")
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out
    assert final.outputs[0].token_ids == expected
    with pytest.raises(LoRANotFoundError):
        engine.remove_lora("x")


@pytest.fixture
def spec(tiny_llama) -> ModelSpec:
    return ModelSpec.from_dir(tiny_llama)


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    path = dst / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config_changes}))
    return dst


@pytest.mark.parametrize("changes, message", [
    ({"use_dora": True}, "DoRA adapters"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "train biases"),
    ({"peft_type": "IA3"}, "is a IA3 adapter"),
    ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
])
def test_unsupported_configs_are_refused(tiny_loras, spec, tmp_path, changes, message):
    bad = _copy(tiny_loras["all4"], tmp_path / "bad", **changes)
    with pytest.raises(LoRAError, match=message):
        load_adapter("bad", bad, spec, max_rank=64)


def test_embedding_targets_and_wrong_shapes_are_refused(tiny_loras, spec, tmp_path):
    from safetensors.torch import save_file

    bad = _copy(tiny_loras["all4"], tmp_path / "embed")
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="targets a module the engine cannot adapt"):
        load_adapter("embed", bad, spec, max_rank=64)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_"
    save_file({key + "A.weight": torch.zeros(4, 32), key + "B.weight": torch.zeros(64, 4)},
              str(bad / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="does not fit this model"):
        load_adapter("shape", bad, spec, max_rank=64)


def test_rank_limit_and_missing_files(tiny_loras, spec, tmp_path):
    with pytest.raises(LoRAError, match="rank 8, above --max-lora-rank 4"):
        load_adapter("some8", tiny_loras["some8"], spec, max_rank=4)
    with pytest.raises(LoRAError, match="is not a directory"):
        load_adapter("gone", tmp_path / "nowhere", spec, max_rank=64)
    with pytest.raises(LoRAError, match="no adapter_config.json"):
        load_adapter("empty", tmp_path, spec, max_rank=64)


def test_bfloat16_engine_applies_adapters(tiny_llama, tiny_loras, monkeypatch):
    """bf16 weights and activations, float32 adapters (lora_batch): the prefill's logits
    stay near PEFT's float32 ones, far nearer than the adapter moves them (bf16 rounding
    differs between CPUs, so no exact equality: a bound relative to the adapter's own
    effect, which a missing or misplaced adapter term would exceed)."""
    llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory="16MiB",
              loras={"all4": str(tiny_loras["all4"])})
    steps = _record_steps(llm, monkeypatch)
    out = llm.generate(["The file object", "The file object"],
                       SamplingParams(max_tokens=1, temperature=0), lora=[None, "all4"])
    got = {name: row.float() for _, name, row in steps[0]}
    ids = torch.tensor([out[0].prompt_token_ids])
    with torch.no_grad():
        base = _reference(str(tiny_llama), None)(ids).logits[0, -1]
        adapted = _reference(str(tiny_llama), str(tiny_loras["all4"]))(ids).logits[0, -1]
    effect = (adapted - base).abs().max().item()
    assert (got["all4"] - adapted).abs().max().item() < 0.1 * effect
    assert (got[None] - base).abs().max().item() < 0.1 * effect


@pytest.mark.parametrize("kv_dtype,bound", [("int8", 0.25), ("fp8", 1.5)])
def test_adapters_over_an_8bit_kv_cache(llm, tiny_llama, tiny_loras, monkeypatch, kv_dtype,
                                        bound):
    """LoRA rows and an 8-bit KV cache (llmctl.serve.layers.kv_quant) in one step: the adapter
    still applies (its effect on these logits is O(1)), and the cache moves the adapter's
    logits as it moves the base model's (int8 < 0.25, fp8 < 1.5 on this model: tests/
    serve/test_kv_cache_int8.py, test_kv_cache_fp8.py), so neither path drops the other."""
    eight = LLM(str(tiny_llama), loras={k: str(v) for k, v in tiny_loras.items()},
                kv_cache_memory="32MiB", max_num_seqs=16, kv_cache_dtype=kv_dtype)
    prompt, params = "The file object", SamplingParams(max_tokens=1, temperature=0)

    def first_logits(engine, lora):
        steps = _record_steps(engine, monkeypatch)
        engine.generate([prompt], params, lora=lora)
        monkeypatch.undo()
        return steps[0][0][2]

    quantized, full = first_logits(eight, "all4"), first_logits(llm, "all4")
    assert 1e-4 < (quantized - full).abs().max().item() < bound
    assert (quantized - first_logits(eight, None)).abs().max().item() > 0.5


# -- the native LoRA sums (csrc/lora.cpp) ----------------------------------------------


def _random_adapter(layers: list[dict[str, tuple[int, int, int]]], seed: int):
    """A LoRAAdapter with random float32 (A, B^T) of the given (rank, in, out) per fused
    linear and layer."""
    from llmctl.serve.lora.adapter import LoRAAdapter

    gen = torch.Generator().manual_seed(seed)
    tensors = [{t: (torch.randn(r, i, generator=gen) * 0.1, torch.randn(r, o, generator=gen))
                for t, (r, i, o) in layer.items()} for layer in layers]
    return LoRAAdapter(name=f"r{seed}", path="-", rank=0, scaling=1.0, layers=tensors)


@pytest.mark.parametrize("rows,rank", [(9, 4), (40, 16)])  # 40 x 16: the threaded branch
def test_native_lora_sums_add_what_the_torch_path_adds(rows, rank):
    """lora_add_bf16 against the torch path of the same LoRABatch (float32 sums, then
    torch's `y += delta.to(bf16)`): base rows untouched bit for bit, adapter rows within
    a bf16 step of the delta and one of the sum (the sums' order differs, which moves a
    rare rounding), on a delta as large as y; an adapter without this linear adds
    nothing."""
    from llmctl.serve.kernels.cpu import lora_kernel
    from llmctl.serve.lora.batch import LoRABatch

    kernel = lora_kernel()
    if kernel is None:
        pytest.skip("no C++ compiler: the native kernels are not built here")
    d_in, d_out = 256, 768
    first = _random_adapter([{"gate_up": (rank, d_in, d_out)}], 1)
    second = _random_adapter([{"gate_up": (rank // 2, d_in, d_out)}], 2)
    untargeted = _random_adapter([{"o": (rank, d_in, d_in)}], 3)
    segments = [(first, slice(0, rows // 3)), (untargeted, slice(rows // 3, rows // 2)),
                (second, slice(rows // 2 + 1, rows))]  # row rows // 2: the base model
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, d_in, generator=gen).bfloat16()
    y0 = torch.randn(rows, d_out, generator=gen).bfloat16()
    native, reference = y0.clone(), y0.clone()
    batch = LoRABatch(segments, kernel)
    assert batch.native is not None
    batch.apply(0, "gate_up", x, native)
    LoRABatch(segments).apply(0, "gate_up", x, reference)  # no kernel: the torch path
    untouched = list(range(rows // 3, rows // 2 + 1))
    assert torch.equal(native[untouched], y0[untouched])
    assert (reference[:rows // 3].float() - y0[:rows // 3].float()).abs().mean() > 0.3
    # Both round the float32 delta to bf16 once, then round y + delta once; summed in
    # another order (torch's bf16 GEMM differs per CPU: AMX tiles on Intel), the delta can
    # round one bf16 step the other way, and the sum then moves by that step plus its own
    # rounding: up to one step of |delta| plus one of |y + delta| (2 steps where they
    # cancel, seen on an Intel AMX Xeon: 1 element of 30720 off by 0.0156 at 1.15).
    delta = (reference.float() - y0.float()).abs()
    bound = 2.0 ** -7 * (delta + reference.float().abs()) + 1e-3
    assert ((native.float() - reference.float()).abs() <= bound).all()
    assert (native != reference).float().mean() < 0.01  # a rare rounding, not a drift
    assert (native != reference).float().mean() < 0.01


def test_segments_merge_adjoining_rows_of_one_adapter_only():
    from llmctl.serve.kernels.cpu import lora_kernel
    from llmctl.serve.lora.batch import LoRABatch

    a, b = _random_adapter([{"o": (4, 8, 8)}], 1), _random_adapter([{"o": (4, 8, 8)}], 2)
    batch = LoRABatch.from_runs([(a, 0, 2), (a, 2, 3), (None, 3, 4), (a, 4, 6), (b, 6, 7),
                                 (a, 7, 8), (a, 8, 8)], "cpu")
    assert [(x.name, r.start, r.stop) for x, r in batch.segments] == [
        ("r1", 0, 3), ("r1", 4, 6), ("r2", 6, 7), ("r1", 7, 8)]
    assert batch.rows == 7
    assert (batch.native is not None) == (lora_kernel() is not None)
    assert LoRABatch.from_runs([(None, 0, 5)], "cpu") is None


def test_adapter_decode_steps_run_the_fused_layers_bit_for_bit_like_the_layer_loop(
        tiny_llama, tiny_loras, monkeypatch):
    """bf16 decode steps mixing three adapters and the base model go through
    csrc/decode_layer.cpp (their adapters' rows are one range each) and give the very
    tokens and log-probs of the Python layer loop, which calls the same LoRA kernel."""
    from llmctl.serve.kernels import cpu as cpu_kernels
    from llmctl.serve.layers import decode_layers
    from llmctl.utils.cpu import cpu_flags

    if cpu_kernels.decode_layer_kernel() is None:
        assert not {"avx2", "fma"} <= cpu_flags()
        pytest.skip("this CPU lacks AVX2 + FMA: no matrix kernel for the fused layers")
    # no prefix caching: the second run would start from cached blocks
    llm = LLM(str(tiny_llama), dtype="bfloat16", max_num_seqs=8, kv_cache_memory="16MiB",
              bf16_gemm="own", enable_prefix_caching=False,
              loras={k: str(v) for k, v in tiny_loras.items()})
    net = llm.engine.target.model
    if net.decode_layers is None:  # e.g. AVX-512 without BF16: oneDNN's bf16, no own form
        assert cpu_kernels.native_variant() not in ("avx512-bf16", "avx2")
        pytest.skip("no fused form for bf16 weights on this CPU's native build")
    adapter_steps = []
    real = decode_layers.DecodeLayers.__call__

    def spy(self, *args):
        lora = args[6] if len(args) > 6 else None
        adapter_steps.append(lora is not None)
        return real(self, *args)

    monkeypatch.setattr(decode_layers.DecodeLayers, "__call__", spy)
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = ["the quick brown", "a b c d e f", "hello", "x y", "one two", "z"]
    names = ["all4", None, "some8", "attn1", "all4", None]
    fused = llm.generate(prompts, params, lora=names)
    assert sum(adapter_steps) >= params.max_tokens - 1  # every decode step, fused
    net.decode_layers = None
    plain = llm.generate(prompts, params, lora=names)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    base = llm.generate(prompts, params)
    assert sum(a.outputs[0].token_ids != b.outputs[0].token_ids
               for a, b in zip(fused, base)) >= 3  # the adapters changed the answers
