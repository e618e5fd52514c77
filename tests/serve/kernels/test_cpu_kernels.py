"""The native CPU kernels against the torch reference paths they replace.

Paged attention is compared with the gather + SDPA path (fresh random caches, shuffled
block tables, contexts that end inside and on tile/block edges, strided queries, every
dispatch branch: AVX-512 or AVX2 float32, AVX512-BF16, the portable loop), in every
instruction-set variant this CPU runs (``isa``: the AVX2 and portable builds on an AVX-512
machine too); the fused bf16 norm and activation with transformers' formulas bit for bit;
the engine with the kernels switched off still runs and agrees; bf16 SmolLM2 on either path
scores a token sequence like float32 transformers within bf16's noise.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest
import torch

from llmctl.serve.kernels import cpu as cpu_kernels
from llmctl.serve.layers.attention import (
    AttnMetadata,
    build_kernel_group,
    build_paged_group,
    paged_attention,
)
from llmctl.utils.cpu import cpu_flags
from tests.serve.paged_cases import CASES, needs_kernels, random_case


def _reference(q, cache, tables, contexts, q_len, num_blocks, scale):
    heads, kv_heads = q.shape[1], cache.shape[3]
    grp = build_paged_group(0, q_len, contexts, tables, block_size=cache.shape[2],
                            num_blocks=num_blocks, group_heads=heads // kv_heads,
                            device=torch.device("cpu"), dtype=torch.float32)
    meta = AttnMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), groups=[grp])
    k = torch.zeros((q.shape[0], kv_heads, q.shape[2]))
    return paged_attention(q.float(), k, k, cache.float(), meta, scale)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("q_len", [1, 3, 20])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_kernel_matches_gather_and_sdpa(case, q_len, dtype, isa):
    heads, kv_heads, head_dim, block_size = CASES[case]
    # contexts: shorter than a tile, exactly one tile/block, odd tails, long
    contexts = [q_len + extra for extra in (0, 5, 15, 16, 31, 33, 200)]
    cache, tables, q, num_blocks = random_case(heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                                         block_size=block_size, contexts=contexts,
                                         q_len=q_len, dtype=dtype)
    scale = head_dim ** -0.5
    kernel = cpu_kernels.paged_attention_kernel(torch.device("cpu"), dtype)
    grp = build_kernel_group(0, q_len, contexts, tables, device=torch.device("cpu"))
    out = kernel(q, cache, grp.block_tables, grp.context_lens, q_len, scale)
    ref = _reference(q, cache, tables, contexts, q_len, num_blocks, scale)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # bf16: the second product rounds probabilities to bf16 (as FlashAttention does)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


@needs_kernels
def test_paged_attention_kernel_reads_only_the_block_table():
    """Garbage (NaN) in blocks the table does not name never reaches the output."""
    contexts = [17, 40]
    cache, tables, q, num_blocks = random_case(heads=9, kv_heads=3, head_dim=64, block_size=16,
                                         contexts=contexts, q_len=1, dtype=torch.bfloat16)
    named = {b for t in tables for b in t}
    for b in set(range(num_blocks)) - named:
        cache[:, b] = float("nan")
    kernel = cpu_kernels.paged_attention_kernel(torch.device("cpu"), torch.bfloat16)
    grp = build_kernel_group(0, 1, contexts, tables, device=torch.device("cpu"))
    out = kernel(q, cache, grp.block_tables, grp.context_lens, 1, 0.125)
    assert torch.isfinite(out).all()


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward for a bf16 input."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_fused_add_rms_norm_matches_transformers(rows, isa):
    ops = cpu_kernels.norm_act_kernels(torch.device("cpu"), torch.bfloat16)
    gen = torch.Generator().manual_seed(rows)
    x = (torch.randn((rows, 576), generator=gen) * 3).bfloat16()
    r = torch.randn((rows, 576), generator=gen).bfloat16()
    w = (torch.rand(576, generator=gen) + 0.5).bfloat16()
    ref_x = x + r
    ref_h = _hf_rms_norm(ref_x, w, 1e-5)
    h = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(x, ref_x)  # the residual add is exact bf16 rounding, in place
    # 1/sqrt against torch.rsqrt may differ in the last float bit: a rare bf16 flip
    assert (h != ref_h).float().mean().item() < 1e-3
    torch.testing.assert_close(h.float(), ref_h.float(), atol=0, rtol=2 ** -7)
    h2 = ops.add_rms_norm(ref_x.clone(), None, w, 1e-5)  # no residual: x untouched
    torch.testing.assert_close(h2.float(), ref_h.float(), atol=0, rtol=2 ** -7)


@needs_kernels
@pytest.mark.parametrize("width", [128, 1536, 1000])  # 1000: a tail past the 16-lane loop
def test_fused_silu_mul_matches_torch(width, isa):
    ops = cpu_kernels.norm_act_kernels(torch.device("cpu"), torch.bfloat16)
    gate_up = (torch.randn((33, 2 * width), generator=torch.Generator().manual_seed(1)) * 4)
    gate_up = gate_up.bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    out = ops.silu_mul(gate_up)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    assert (out != ref).float().mean().item() < 1e-3  # polynomial exp: rare 1-ulp flips
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=2 ** -7)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 100])  # 100: the multi-threaded branch
@pytest.mark.parametrize("qk_norm", [False, True])  # True: q/k in their own tensor
def test_fused_rope_and_cache_write_match_the_torch_path(tokens, qk_norm, isa):
    """Rotation and cache write as apply_rope + index_copy_ do them: the same float32
    products rounded to bfloat16 (a fused multiply-add in either may move a rare value
    by one bf16 step), K/V landing at exactly the slots given, nothing else written."""
    from llmctl.serve.layers.rope import apply_rope, rope_freqs, rope_parameters

    nh, nkv, d, block = 9, 3, 64, 16
    gen = torch.Generator().manual_seed(tokens)
    freqs = rope_freqs(rope_parameters({"rope_theta": 10000.0}), d, 2048, 512)
    kernel = cpu_kernels.rope_kv_kernel(torch.device("cpu"), torch.bfloat16, freqs)
    qkv = (torch.randn(tokens, (nh + 2 * nkv) * d, generator=gen) * 3).bfloat16()
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    slots = torch.randperm(40 * block, generator=gen)[:tokens]
    cache = torch.randn(2, 40, block, nkv, d, generator=gen).bfloat16()
    v = qkv[:, (nh + nkv) * d:].view(tokens, nkv, d)
    qk = qkv[:, :(nh + nkv) * d].view(tokens, nh + nkv, d)
    if qk_norm:
        qk = qk * 1.5  # a new contiguous tensor, as the q/k norm makes
    want_qk = apply_rope(qk, freqs[positions].unsqueeze(1))
    want_cache = cache.clone()
    want_cache[0].view(-1, nkv, d).index_copy_(0, slots, want_qk[:, nh:])
    want_cache[1].view(-1, nkv, d).index_copy_(0, slots, v)
    kernel(qk, v, positions, slots, cache)
    assert (qk != want_qk).float().mean().item() < 1e-3
    torch.testing.assert_close(qk.float(), want_qk.float(), atol=1e-6, rtol=2 ** -7)
    written = torch.zeros(40 * block, dtype=torch.bool)
    written[slots] = True
    for i in range(2):
        flat, ref = cache[i].view(-1, nkv, d), want_cache[i].view(-1, nkv, d)
        assert torch.equal(flat[~written], ref[~written])
    assert torch.equal(cache[0].view(-1, nkv, d)[slots], qk[:, nh:])
    assert torch.equal(cache[1].view(-1, nkv, d)[slots], v)


def test_kernels_absent_for_other_devices_and_dtypes():
    assert cpu_kernels.paged_attention_kernel(torch.device("meta"), torch.float32) is None
    assert cpu_kernels.paged_attention_kernel(torch.device("cpu"), torch.float16) is None
    assert cpu_kernels.norm_act_kernels(torch.device("cpu"), torch.float32) is None
    freqs = torch.ones(4, 2, dtype=torch.complex64)
    assert cpu_kernels.rope_kv_kernel(torch.device("cpu"), torch.float32, freqs) is None


def test_a_failed_build_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    fake = tmp_path / "c++"
    fake.write_text("#!/bin/sh\necho 'fatal: no compiler today' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path / "home"))
    cpu_kernels.load_variant.cache_clear()
    try:
        assert cpu_kernels.paged_attention_kernel(torch.device("cpu"), torch.float32) is None
        assert "building the CPU kernels failed" in caplog.text
        assert "no compiler today" in caplog.text
        assert not list((tmp_path / "home" / "kernels").glob("*.so"))  # nothing half-built
    finally:
        cpu_kernels.load_variant.cache_clear()


CSRC = Path(cpu_kernels.__file__).parent / "csrc"


def test_every_kernel_file_is_hashed_and_packaged():
    """A header the .cpp files include is part of the build key (editing it rebuilds) and
    of the package data (an installed llmctl can compile the kernels)."""
    import re

    on_disk = {p.name for p in CSRC.iterdir() if p.suffix in (".cpp", ".h")}
    assert {p.name for p in cpu_kernels.SOURCES} == on_disk
    included = {name for src in cpu_kernels.SOURCES
                for name in re.findall(r'#include "([^"]+)"', src.read_text())}
    assert included and included <= on_disk
    # [tool.setuptools.package-data] (read by pattern: tomllib is not in Python 3.10)
    pyproject = (Path(__file__).parents[3] / "pyproject.toml").read_text()
    patterns = re.findall(r'"([^"]+)"', re.search(r'^"llmctl\.serve\.kernels" = \[(.*)\]$', pyproject,
                                                  re.MULTILINE).group(1))
    assert "csrc/*.cpp" in patterns
    assert all(any(fnmatch.fnmatch(f"csrc/{name}", pat) for pat in patterns) for name in on_disk)


def test_editing_the_shared_header_rebuilds(monkeypatch, tmp_path):
    # a stand-in compiler that writes an empty library: only the build key is under test
    fake = tmp_path / "c++"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && { shift; : > "$1"; }; '
                    'shift; done\n')
    fake.chmod(0o755)
    copies = []
    for src in cpu_kernels.SOURCES:
        copies.append(tmp_path / "csrc" / src.name)
        copies[-1].parent.mkdir(exist_ok=True)
        copies[-1].write_text(src.read_text())
    monkeypatch.setattr(cpu_kernels, "SOURCES", tuple(copies))
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path / "home"))
    first = cpu_kernels._build(str(fake))
    assert cpu_kernels._build(str(fake)) == first  # unchanged sources: the cached build
    header = tmp_path / "csrc" / "simd_math.h"
    header.write_text(header.read_text() + "\n// edited\n")
    second = cpu_kernels._build(str(fake))
    assert second != first and second.is_file()


def test_each_unit_compiles_in_its_own_process_then_one_link(monkeypatch, tmp_path):
    """The build runs one compiler process per .cpp (side by side, as many as there are
    cores) and links their objects once, with the same flags."""
    log = tmp_path / "calls"
    fake = tmp_path / "c++"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {log}\n'
                    'while [ $# -gt 0 ]; do [ "$1" = -o ] && { shift; : > "$1"; }; shift; done\n')
    fake.chmod(0o755)
    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path / "home"))
    built = cpu_kernels._build(str(fake), "avx2")
    calls = [line.split() for line in log.read_text().splitlines() if "--version" not in line]
    units = sorted(str(src) for src in cpu_kernels.SOURCES if src.suffix == ".cpp")
    compiles = [c for c in calls if "-c" in c]
    assert sorted(c[-1] for c in compiles) == units
    (link,) = [c for c in calls if "-c" not in c]
    objects = sorted(c[c.index("-o") + 1] for c in compiles)
    assert sorted(a for a in link if a.endswith(".o")) == objects
    flags = (*cpu_kernels.FLAGS, *cpu_kernels.VARIANTS["avx2"][0])
    assert all(set(flags) <= set(c) for c in calls)
    assert built.is_file() and not list(built.parent.glob(".llmctl_cpu-objs-*"))


@pytest.mark.usefixtures("kernels_off")
def test_engine_greedy_on_the_torch_path_equals_transformers(tiny_llama):
    from llmctl.serve.engine.llm import LLM
    from tests.serve.engine.test_engine_greedy import _check_against_hf

    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    assert llm.engine.runner.kernel is None
    _check_against_hf(tiny_llama, llm)


# bf16 against float32, teacher-forced. Greedy tokens in bf16 are not a reference: where two
# logits lie within a bf16 rounding of each other the choice flips, and which way depends on
# the CPU (AMX or not, oneDNN's kernel). So the engine's log-probs of one token sequence (the
# prompt and its own continuation, each token scored given the ones before it) are compared
# with transformers' float32 log-probs of the same sequence. Measured on SmolLM2, AMD Zen 4
# (AVX512-BF16, no AMX), these 6 prompts, 112 scored tokens: mean |error| 0.042 nats on the
# kernel path, 0.050 on the torch path (a bootstrap over tokens puts either mean's
# standard error near 0.007); top-1 differed only where float32's top-2 were within 0.23
# nats. Kernel bugs measured with the same check: a context one token short 0.61 (top-1 wrong
# at margins up to 2.6), attention scale x1.1 0.087, norm output x1.02 0.085.
BF16_MEAN_ABS_LOGPROB = 0.08  # > 4 standard errors above either path's mean
BF16_SURE_MARGIN = 1.0  # nats: a top-1 this far ahead of the top-2 cannot flip in bf16


def _bf16_logprobs_vs_float32(path, kernels: bool) -> tuple[float, list[tuple[int, float]]]:
    """Mean |engine bf16 - transformers float32| log-prob over every scored token, and the
    (position, float32 margin) of top-1 disagreements."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM
    from tests.serve.conftest import PROMPTS, encode, hf_model

    # a 16-token budget cuts the longer prompts into chunks: prefill with context goes
    # through the kernel (q_len <= 32) as well as every decode (q_len 1)
    llm = LLM(str(path), dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=256,
              max_num_batched_tokens=16)
    assert (llm.engine.runner.kernel is not None) == kernels
    assert isinstance(llm.engine.target.model.norm_act, cpu_kernels.NormActKernels) == kernels
    # where oneDNN cannot pack bf16 (AVX2-only CPUs) the dense layers widen bf16 weights
    # to float32 (csrc/gemv_bf16_avx2.cpp) with the kernels on, F.linear in bf16 without
    from llmctl.serve.layers.quant_linear import DenseLinear, WideningBF16Linear, packing_available

    model = llm.engine.target.model
    if not packing_available(torch.bfloat16, torch.device("cpu")):
        widening = kernels and cpu_kernels.gemm_bf16w_avx2_kernel() is not None
        want = WideningBF16Linear if widening else DenseLinear
        assert all(isinstance(getattr(layer, name), want) for layer in model.layers
                   for name in ("qkv", "o", "gate_up", "down")), want
        assert isinstance(model.lm_head, want)
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=1, prompt_logprobs=1)
    outs = llm.generate([encode(path, p) for p in PROMPTS], params)
    errors, flips = [], []
    for out in outs:
        seq = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.inference_mode():
            ref = torch.log_softmax(hf_model(str(path))(torch.tensor([seq])).logits[0].float(), -1)
        # entry p scores token p + 1 (the prompt's first token has no entry)
        entries = out.prompt_logprobs[1:] + out.outputs[0].logprobs
        assert len(entries) == len(seq) - 1
        for p, entry in enumerate(entries):
            assert entry.token_id == seq[p + 1]
            errors.append(abs(entry.logprob - ref[p, seq[p + 1]].item()))
            top2 = ref[p].topk(2)
            if entry.top[0][0] != top2.indices[0].item():
                flips.append((p, (top2.values[0] - top2.values[1]).item()))
    return sum(errors) / len(errors), flips


@pytest.mark.slow
@pytest.mark.parametrize("kernels", [pytest.param(True, marks=needs_kernels), False],
                         ids=["kernels", "torch"])
def test_smollm2_bf16_log_probs_match_float32(smollm2, kernels, monkeypatch):
    """bf16 SmolLM2 through the engine, kernels on and off, against float32 transformers on
    the same token sequences (mixed prompt lengths, chunked prefill, decodes)."""
    monkeypatch.setenv("LLMCTL_CPU_KERNELS", "1" if kernels else "0")
    cpu_kernels.load_variant.cache_clear()
    try:
        mean_err, flips = _bf16_logprobs_vs_float32(smollm2, kernels)
    finally:
        cpu_kernels.load_variant.cache_clear()
    assert mean_err <= BF16_MEAN_ABS_LOGPROB, (mean_err, flips)
    assert not [f for f in flips if f[1] >= BF16_SURE_MARGIN], flips


def test_packed_linear_matches_f_linear_for_bf16_and_float32(monkeypatch):
    from llmctl.serve.layers.quant_linear import (
        DenseLinear,
        PackedLinear,
        WideningBF16Linear,
        dense_linear,
        onednn_bf16_supported,
        packing_available,
    )

    cpu = torch.device("cpu")
    if not packing_available(torch.float32, cpu):
        pytest.skip("torch here has no oneDNN weight packing")
    gen = torch.Generator().manual_seed(3)
    w = torch.randn((96, 64), generator=gen).bfloat16()
    b = torch.randn(96, generator=gen).bfloat16()
    layer = dense_linear(w, b)
    if onednn_bf16_supported():
        assert isinstance(layer, PackedLinear) and layer.out_features == 96
    else:  # oneDNN refuses bf16 packing on an AVX2-only CPU: csrc/gemv_bf16_avx2.cpp's
        # widening layer where this build has it, else the plain (emulated) one
        flags = cpu_flags()
        assert not {"avx512bw", "avx512vl", "avx512dq"} <= flags and "avx_ne_convert" not in flags
        assert isinstance(layer, WideningBF16Linear if cpu_kernels.gemm_bf16w_avx2_kernel()
                          else DenseLinear)
    assert layer.nbytes == w.numel() * 2 + b.numel() * 2
    for rows in (1, 5, 128):
        x = torch.randn((rows, 64), generator=gen).bfloat16()
        torch.testing.assert_close(layer(x).float(), torch.nn.functional.linear(x, w, b).float(),
                                   atol=0.05, rtol=0.02)
    # float32: oneDNN's blocked GEMM sums in another order than F.linear's: float32
    # rounding of a 64-term sum of O(1) products (~1e-5 relative), far below 1e-4
    layer32 = dense_linear(w.float(), b.float())
    assert isinstance(layer32, PackedLinear) and layer32.nbytes == w.numel() * 4 + b.numel() * 4
    for rows in (1, 5, 128):
        x = torch.randn((rows, 64), generator=gen)
        torch.testing.assert_close(layer32(x), torch.nn.functional.linear(x, w.float(), b.float()),
                                   atol=1e-4, rtol=1e-4)
    assert isinstance(dense_linear(w.half(), None), DenseLinear)  # float16: not packed
    monkeypatch.setenv("LLMCTL_CPU_KERNELS", "0")
    assert isinstance(dense_linear(w, None), DenseLinear)


@needs_kernels
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_own_kernel_is_the_float32_product_rounded_once(with_bias, isa):
    """csrc/gemm_bf16.cpp at any number of rows (one row block, several, uneven splits),
    in each variant with the kernel (native: with the AMX tile unit from 8 rows where the
    CPU has it; avx512-bf16: vdpbf16ps at every row count): exact bf16 products summed
    in float32 and rounded once, so each output is the float64 product rounded to bf16 up
    to one step (the sum's float32 rounding may cross a bf16 boundary). "both" keeps the
    own kernel to both_rows() rows and gives larger batches to oneDNN, bit for bit the
    oneDNN-only layer."""
    from llmctl.serve.layers.quant_linear import PackedLinear, packing_available

    if cpu_kernels.gemm_bf16_kernel() is None:
        # only a variant without it (avx512, avx2, portable) or a CPU without it lacks it
        assert isa not in ("native", "avx512-bf16") or "avx512_bf16" not in cpu_flags()
        pytest.skip(f"the {isa} build has no AVX512-BF16 kernel")
    if not packing_available(torch.bfloat16, torch.device("cpu")):
        pytest.skip("torch here has no oneDNN weight packing")
    gen = torch.Generator().manual_seed(5)
    def ulp(v: torch.Tensor) -> torch.Tensor:  # one bf16 step at v's magnitude
        return 2.0 ** (torch.floor(torch.log2(v.abs().clamp_min(1e-30))) - 7)

    # k = 96: whole 32-input chunks for the AMX tiles; 104: 8 more inputs after them
    for k in (96, 104):
        w = torch.randn((40, k), generator=gen).bfloat16()  # 40: pads to a pair of blocks
        b = torch.randn(40, generator=gen).bfloat16() if with_bias else None
        own, both, plain = (PackedLinear(w, b, gemm=g) for g in ("own", "both", "onednn"))
        assert own.weight is None and both.weight is not None
        assert both.own_rows == PackedLinear.both_rows()
        # rows around the AMX path's threshold (8), its 16-row tiles and 32-row passes
        for rows in (1, 2, 3, 4, 5, 7, 8, 9, 13, 16, 17, 32, 33, 40, 70):
            x = torch.randn((rows, k), generator=gen).bfloat16()
            exact = x.double() @ w.double().T
            got = own(x)
            if rows <= both.own_rows:
                assert torch.equal(both(x), got)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 40)
            want = exact.float().bfloat16().double()
            bound = ulp(exact)
            if b is not None:  # the bias is added to the rounded product: one more rounding
                want = want + b.double()
                bound = bound + ulp(want)
            assert ((got.double() - want).abs() <= bound).all(), (k, rows)
        x = torch.randn((both.own_rows + 1, k), generator=gen).bfloat16()
        assert torch.equal(both(x), plain(x))
    x3 = torch.randn((2, 3, k), generator=gen).bfloat16()  # 3-D: flattened to 6 rows
    assert torch.equal(own(x3), own(x3.reshape(6, k)).view(2, 3, 40))


@needs_kernels
def test_the_bf16_kernel_takes_the_amx_tile_unit_where_the_cpu_has_it():
    """csrc/gemm_bf16.cpp's AMX path: on in a native build on a CPU with AMX-BF16 (Linux
    grants the tile state), off in the avx512-bf16 variant (no AMX in its -march), so on
    such a CPU the test above runs both paths; "both" then keeps decode batches (up to
    AMX_ROWS) on the own kernel."""
    from llmctl.serve.layers.quant_linear import PackedLinear

    if cpu_kernels.gemm_bf16_kernel() is None:
        pytest.skip("this CPU has no AVX512-BF16")
    has_amx = "amx_bf16" in cpu_flags() and cpu_kernels.selected_variant() == "native"
    assert cpu_kernels.gemm_bf16_amx_rows() == (8 if has_amx else 0)
    assert PackedLinear.both_rows() == (PackedLinear.AMX_ROWS if has_amx
                                        else PackedLinear.SMALL_ROWS)


def test_the_bf16_gemm_plan_follows_the_setting_the_cpu_and_memory(monkeypatch):
    from llmctl.serve.model.decoder import ModelSpec
    from llmctl.serve.model.weights import bf16_gemm_plan, dense_parameters

    spec = ModelSpec.from_config({
        "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 256, "tie_word_embeddings": True})
    # 2 layers x (q, k, v, o: 64 x (2 x 4 + 2 x 2) x 16 + mlp 3 x 64 x 128) + head 1000 x 64
    assert dense_parameters(spec) == 2 * (64 * 12 * 16 + 3 * 64 * 128) + 1000 * 64
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert bf16_gemm_plan("own", spec, bf16, cpu) == "own"
    assert bf16_gemm_plan("onednn", spec, bf16, cpu) == "onednn"
    assert bf16_gemm_plan("own", spec, torch.float32, cpu) == "onednn"  # bf16 weights only
    flags = {"avx512_bf16"}
    monkeypatch.setattr("llmctl.serve.model.weights.cpu_flags", lambda: frozenset(flags))
    assert bf16_gemm_plan("auto", spec, bf16, cpu) == "own"  # no AMX: one copy, own kernel
    flags.add("amx_bf16")
    assert bf16_gemm_plan("auto", spec, bf16, cpu) == "both"  # AMX: oneDNN + a small copy
    pages = 2 * dense_parameters(spec) * 8 // 4096 - 1  # memory just too small for it
    monkeypatch.setattr("os.sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else pages)
    assert bf16_gemm_plan("auto", spec, bf16, cpu) == "onednn"
    assert bf16_gemm_plan("own", spec, bf16, cpu) == "own"  # one copy: no memory question


@needs_kernels
@pytest.mark.parametrize("scheme", [None, "w4-g32-sym", "w8-g32"])
def test_one_native_call_per_layer_decodes_bit_for_bit_like_the_layer_by_layer_path(
        tiny_llama, tmp_path, scheme, monkeypatch):
    """Small decode steps through csrc/decode_layer.cpp give the very logits of the
    Python layer loop (same kernels, same order): greedy tokens and log-probs of
    concurrent requests compared exactly, bf16 dense (ten requests: two of the GEMM's
    8-row blocks) and int4/int8 codes (six: the VNNI kernel takes up to 8 rows, and its
    second pass over rows 5-8 runs too). On this CPU's native build: AVX512-BF16 / VNNI
    forms, or the AVX2 ones (test_decode_layer_avx2.py runs those on any AVX2 CPU)."""
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM
    from llmctl.serve.layers import decode_layers
    from llmctl.serve.layers.quant_linear import WideningBF16Linear
    from tests.serve.quant_checkpoints import write_quantized

    if cpu_kernels.decode_layer_kernel() is None:
        assert not {"avx2", "fma"} <= cpu_flags()
        pytest.skip("this CPU lacks AVX2 + FMA: no matrix kernel for the fused layers")
    model = tiny_llama if scheme is None else write_quantized(tiny_llama, tmp_path / "q", scheme)[0]
    llm = LLM(str(model), dtype="bfloat16", max_num_seqs=10, kv_cache_memory="16MiB",
              bf16_gemm="own")
    net = llm.engine.target.model
    if net.decode_layers is None:  # e.g. AVX-512 without BF16: oneDNN's bf16, no own form
        assert cpu_kernels.native_variant() not in ("avx512-bf16", "avx2")
        pytest.skip("no fused form for these weights on this CPU's native build")
    # the most rows of each form (decode_layer.cpp's Matrix.kind)
    form_rows = {0: decode_layers.MAX_ROWS, 1: 8, 2: WideningBF16Linear.KERNEL_MAX_ROWS,
                 3: decode_layers.MAX_ROWS}
    kinds = {m.kind for mats in net.decode_layers._matrices for m in mats}
    calls = []
    real = decode_layers.DecodeLayers.__call__
    monkeypatch.setattr(decode_layers.DecodeLayers, "__call__",
                        lambda self, *a: calls.append(a[0].shape[0]) or real(self, *a))
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = ["the quick brown", "a b c d e f", "hello", "x y", "one two three", "z",
               "red green", "up down left", "seven", "last one"][:10 if scheme is None else 6]
    fused = llm.generate(prompts, params)
    assert net.decode_layers.max_rows == min(form_rows[k] for k in kinds)
    if cpu_kernels.native_variant() == "avx512-bf16":
        assert kinds == ({0} if scheme is None else {1})
    assert calls and max(calls) == len(prompts)
    net.decode_layers = None
    plain = llm.generate(prompts, params)
    for a, b in zip(fused, plain):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@needs_kernels
@pytest.mark.parametrize("seqs,length,heads,kv_heads,d", [
    (2, 5, 4, 2, 64),      # shorter than a 16-key tile
    (3, 37, 9, 3, 64),     # SmolLM2's heads, ragged last tile
    (2, 130, 8, 2, 128),   # head_dim 128, two query blocks of 128
    (1, 17, 6, 6, 64),     # no GQA
])
def test_prefill_attention_is_causal_attention_within_bf16_rounding(seqs, length, heads,
                                                                    kv_heads, d, isa):
    """csrc/prefill_attention.cpp against float64 causal attention on the same bf16 q/k/v
    (views of one qkv row, as the model passes them): the probabilities are rounded to
    bf16 for the second product and the output to bf16, each half a step (2^-9 relative);
    the bound allows four such steps of the largest output."""
    import math

    fn = cpu_kernels.prefill_attention_kernel(torch.device("cpu"), torch.bfloat16)
    if fn is None:  # only a build without AVX512-BF16 bodies may lack the kernel
        assert isa not in ("native", "avx512-bf16") or "avx512_bf16" not in cpu_flags()
        pytest.skip(f"the {isa} build has no AVX512-BF16 prefill kernel")
    gen = torch.Generator().manual_seed(length)
    tokens = seqs * length
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d + 16, generator=gen).bfloat16()
    q = qkv[:, :heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d:(heads + 2 * kv_heads) * d].view(tokens, kv_heads, d)
    scale = 1 / math.sqrt(d)
    got = fn(q, k, v, seqs, length, scale)
    assert got.dtype == torch.bfloat16 and got.shape == (tokens, heads * d)

    def per_seq(t: torch.Tensor) -> torch.Tensor:
        out = t.double().view(seqs, length, t.shape[1], d).transpose(1, 2)
        return out.repeat_interleave(heads // t.shape[1], 1)

    want = torch.nn.functional.scaled_dot_product_attention(
        per_seq(q), per_seq(k), per_seq(v), is_causal=True, scale=scale)
    want = want.transpose(1, 2).reshape(tokens, heads * d)
    assert (got.double() - want).abs().max() <= 4 * 2.0 ** -9 * want.abs().max()
    # a head_dim the kernel does not take: None, the caller keeps SDPA
    q32 = torch.zeros(4, 2, 32).bfloat16()
    assert fn(q32, q32, q32, 1, 4, 1.0) is None
