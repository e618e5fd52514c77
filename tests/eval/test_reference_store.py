"""The reference store: compact layout, reuse across candidates, use as --reference."""

from __future__ import annotations

import numpy as np
import pytest

from llmctl.eval.candidates import HFCandidate
from llmctl.eval.runner import EvalConfig, run_eval
from llmctl.eval.windows import Windowing

WINDOWING = Windowing(ctx=48, max_windows=3)


def _config(candidate, reference, cache, **kw):
    return EvalConfig(candidate=str(candidate), reference=str(reference), windowing=WINDOWING,
                      top_k=8, cache_dir=cache, **kw)


def test_layout_and_reuse(tiny_llama, tiny_perturbed, tmp_path, monkeypatch):
    from safetensors import safe_open

    first = run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))
    (path,) = tmp_path.glob("*.safetensors")
    with safe_open(str(path), framework="np") as f:
        shapes = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    n = 3 * 47
    assert shapes["top_ids"] == ([n, 8], "U16") and shapes["top_logprobs"] == ([n, 8], "F32")
    assert shapes["tail_logprob"] == ([n], "F32") and shapes["input_ids"] == ([3, 48], "I32")
    assert first["metadata"]["reference"]["store"] == str(path)

    def no_forward(self, ids):
        raise AssertionError("the reference model ran again")

    calls = []
    real = HFCandidate.logits
    monkeypatch.setattr(HFCandidate, "logits", lambda self, ids: (
        calls.append(self.spec), no_forward(self, ids) if self.spec == str(tiny_llama)
        else real(self, ids))[1])
    again = run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))
    assert set(calls) == {str(tiny_perturbed)}  # only the candidate ran
    assert again["metrics"]["mean_kld"] == first["metrics"]["mean_kld"]
    assert first["metadata"]["reference"]["store_reused"] is False
    assert again["metadata"]["reference"]["store_reused"] is True


def test_another_dtype_or_library_version_scores_the_reference_again(
        tiny_llama, tiny_perturbed, tmp_path, monkeypatch):
    """The reference's log-probs in bfloat16 are not its float32 ones, nor are another
    torch's: neither may be taken from the cache."""
    run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))
    bf16 = run_eval(_config(tiny_perturbed, tiny_llama, tmp_path, dtype="bfloat16"))
    assert bf16["metadata"]["reference"]["store_reused"] is False
    assert len(list(tmp_path.glob("*.safetensors"))) == 2
    import llmctl.report

    monkeypatch.setattr(llmctl.report, "package_versions",
                        lambda names: {n: "0.0-other" for n in names})
    upgraded = run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))
    assert upgraded["metadata"]["reference"]["store_reused"] is False
    assert len(list(tmp_path.glob("*.safetensors"))) == 3


def test_a_store_file_is_a_reference(tiny_llama, tiny_perturbed, tmp_path):
    by_model = run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))
    store = by_model["metadata"]["reference"]["store"]
    by_store = run_eval(_config(tiny_perturbed, store, tmp_path / "unused"))
    assert by_store["metrics"]["mean_kld"] == by_model["metrics"]["mean_kld"]
    assert by_store["metadata"]["data"] == by_model["metadata"]["data"]


def test_a_corrupt_store_is_rebuilt(tiny_llama, tiny_perturbed, tmp_path):
    good = run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))["metrics"]["mean_kld"]
    (path,) = tmp_path.glob("*.safetensors")
    path.write_bytes(b"not a safetensors file")
    assert run_eval(_config(tiny_perturbed, tiny_llama, tmp_path))["metrics"]["mean_kld"] == good


def test_different_tokenizers_are_refused(tiny_llama, tmp_path_factory, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmctl.errors import ConfigError

    # Same tokenizer, but 600 output tokens instead of 512 (a padded vocabulary).
    other = tmp_path_factory.mktemp("other") / "m"
    config = AutoConfig.from_pretrained(str(tiny_llama))
    config.vocab_size = 600
    AutoModelForCausalLM.from_config(config).save_pretrained(str(other))
    AutoTokenizer.from_pretrained(str(tiny_llama)).save_pretrained(str(other))
    with pytest.raises(ConfigError, match="output tokens"):
        run_eval(_config(other, tiny_llama, tmp_path))
    assert np.isfinite(run_eval(EvalConfig(candidate=str(other), windowing=WINDOWING,
                                           cache_dir=tmp_path))["metrics"]["ppl"])
