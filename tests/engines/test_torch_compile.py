import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from llmctl.engines.torch_compile_target import ISA_LEVELS, required_flags
from tests.engines.conftest import PROMPTS, hf_greedy, hf_logits

REPO = Path(__file__).resolve().parents[2]

# The fresh process may not trace or compile anything: those entry points raise.
FRESH = """
import json, sys
import torch, torch.export, torch._inductor, torch._inductor.compile_fx as cfx

def refuse(*args, **kwargs):
    raise RuntimeError("tried to compile at load time")

torch.export.export = torch._inductor.aoti_compile_and_package = refuse
cfx.compile_fx = cfx.compile_fx_aot = torch.compile = refuse
from llmctl.engines.engine_dir import open_engine
engine = open_engine(sys.argv[1], threads=1)
prompts = json.loads(sys.argv[2])
outs = engine.generate(prompts, max_tokens=32, ignore_eos=True)
print(json.dumps({"outs": outs, "logits": engine.logits(prompts[0]).tolist()}))
"""


def test_package_loads_in_a_fresh_process_and_matches_eager(torch_compiled, hf_tiny,
                                                            tiny_llama, tmp_path):
    import torch

    from llmctl.engines.static_decoder import build_static_decoder

    proc = subprocess.run([sys.executable, "-c", FRESH, str(torch_compiled),
                           json.dumps(PROMPTS)], capture_output=True, text=True, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1",
                               # an empty compile cache: nothing reused from the build
                               "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")},
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for prompt, out in zip(PROMPTS, got["outs"]):
        assert out == hf_greedy(hf_tiny, prompt, 32)
    # eager: the same decoder module, uncompiled
    decoder, spec = build_static_decoder(tiny_llama, torch.float32, 128)
    ids = torch.tensor([PROMPTS[0]])
    empty = torch.zeros(spec.num_layers, 1, spec.num_kv_heads, 1, spec.head_dim)
    with torch.inference_mode():
        eager = decoder(ids, torch.tensor([0]), empty, empty)[0][0].numpy()
    np.testing.assert_allclose(np.asarray(got["logits"]), eager, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(eager, hf_logits(hf_tiny, PROMPTS[0]), atol=1e-4, rtol=1e-4)


def test_chunked_prefill_and_rollback_match_full_logits(torch_compiled, hf_tiny):
    from llmctl.engines.engine_dir import open_engine

    engine = open_engine(torch_compiled, threads=1)
    ids = PROMPTS[2] + PROMPTS[0]
    want = hf_logits(hf_tiny, ids)
    rt = engine.runtime
    state = rt.new_state()
    a = rt.forward([state], [ids[:6]], all_logits=True)[0]
    b = rt.forward([state], [ids[6:9]], all_logits=True)[0]
    rt.forward([state], [[1]])  # a token that is then rolled back (rejected draft)
    state.length = 9
    c = rt.forward([state], [ids[9:]], all_logits=True)[0]
    np.testing.assert_allclose(np.concatenate([a, b, c]), want, atol=1e-4, rtol=1e-4)


def test_batch_larger_than_the_compiled_maximum_is_split(torch_compiled, hf_tiny):
    from llmctl.engines.engine_dir import open_engine

    engine = open_engine(torch_compiled, threads=1)
    assert engine.runtime.max_batch_size == 4
    prompts = [PROMPTS[i % 3] + [i] for i in range(6)]
    outs = engine.generate(prompts, max_tokens=8, ignore_eos=True)
    for prompt, out in zip(prompts, outs):
        assert out == hf_greedy(hf_tiny, prompt, 8)


def test_manifest_requires_exact_torch_and_the_build_isa(torch_compiled):
    import torch

    from llmctl.engines.host import cpu_flags

    manifest = json.loads((torch_compiled / "llmctl-engine.json").read_text())
    req = manifest["requirements"]
    assert req["packages"]["torch"] == {"version": torch.__version__, "match": "exact"}
    assert set(req["cpu_flags"]) <= cpu_flags()
    assert manifest["target_info"]["inductor_configs"]["aot_inductor.compile_wrapper_opt_level"] \
        == "O0"


@pytest.mark.parametrize("isa,must,must_not", [
    ("x86-64-v3", {"avx2", "fma"}, {"avx512f"}),
    ("x86-64-v4", {"avx2", "avx512f", "avx512bw"}, {"amx_tile"}),
])
def test_named_isa_levels_require_only_their_flags(isa, must, must_not):
    host = frozenset({"avx2", "fma", "avx512f", "avx512bw", "amx_tile", "sse4_2"})
    flags = set(required_flags(isa, host))
    assert must <= flags and not (must_not & flags)
    assert ISA_LEVELS[isa][1] in (256, 512)


def test_native_isa_requires_the_build_cpus_extensions():
    host = frozenset({"avx2", "amx_tile", "hypervisor", "fpu", "avx512f"})
    assert required_flags("native", host) == ["amx_tile", "avx2", "avx512f"]


def test_sampling_draws_what_the_serving_engine_draws(torch_compiled, tiny_llama):
    """Engine.generate samples with the serving engine's sampler (llmctl.serve.sample.sampler):
    seeded, it draws the tokens llmctl's engine draws from the source checkpoint. Float32,
    so both see the same logits to ~1e-5; a flip needs two tokens' p/E that close."""
    from llmctl.engines.engine_dir import open_engine
    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    engine = open_engine(torch_compiled, threads=1)
    llm = LLM(str(tiny_llama), kv_cache_memory="8MiB")
    for seed, prompt in enumerate(PROMPTS):
        for top_p in (1.0, 0.8):
            params = SamplingParams(max_tokens=16, temperature=0.9, top_p=top_p, seed=seed,
                                    ignore_eos=True)
            want = llm.generate([prompt], params)[0].outputs[0].token_ids
            got = engine.generate(prompt, max_tokens=16, temperature=0.9, top_p=top_p,
                                  seed=seed, ignore_eos=True)
            assert got == want, (seed, top_p)
    # a batch: prompt i draws as a request seeded seed + i, whatever else is in the batch
    batch = engine.generate(PROMPTS, max_tokens=16, temperature=0.9, seed=5, ignore_eos=True)
    alone = [engine.generate(p, max_tokens=16, temperature=0.9, seed=5 + i, ignore_eos=True)
             for i, p in enumerate(PROMPTS)]
    assert batch == alone
    assert len({tuple(out) for out in batch}) == len(PROMPTS)  # not a constant draw
