"""The one place that picks device and dtype: ``--dtype auto`` on faked CPUs and GPUs."""

import pytest

from llmctl.errors import UsageError
from llmctl.models.resolve import checkpoint_dtype
from llmctl.utils import device

ZEN4 = frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"})  # AMD Zen 4: no AMX
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "amx_tile", "amx_int8", "amx_bf16"})
HASWELL = frozenset({"avx2", "fma"})


def _never():
    raise AssertionError("a CPU choice must not read the checkpoint")


@pytest.mark.parametrize("flags,dtype,reason", [
    (ZEN4, "bfloat16", "CPU has AVX512-BF16"),
    (SAPPHIRE_RAPIDS, "bfloat16", "CPU has AMX-BF16"),
    (HASWELL, "float32", "CPU without native bfloat16"),
])
def test_auto_on_cpu_follows_native_bf16(flags, dtype, reason):
    choice = device.resolve_dtype("auto", device="cpu", flags=flags, model_dtype=_never)
    assert (choice.dtype, choice.reason) == (dtype, reason)
    assert choice.describe() == f"dtype auto -> {dtype} ({reason})"


@pytest.mark.parametrize("requested,expected", [("float32", "float32"), ("fp32", "float32"),
                                                ("bf16", "bfloat16"), ("float16", "float16")])
def test_explicit_dtype_wins_everywhere(requested, expected):
    for where in ("cpu", "cuda"):
        choice = device.resolve_dtype(requested, device=where, flags=ZEN4, model_dtype=_never)
        assert choice.dtype == expected and choice.reason == "as requested"


@pytest.mark.parametrize("own,bf16_gpu,expected", [
    ("bfloat16", True, "bfloat16"),
    ("bfloat16", False, "float16"),  # e.g. a V100 / T4
    ("float16", True, "float16"),
    ("float32", True, "float32"),
    (None, True, "float32"),
    ("int8", True, "float32"),  # not a float type: no claim about the compute dtype
])
def test_auto_on_gpu_takes_the_checkpoint_dtype(monkeypatch, own, bf16_gpu, expected):
    monkeypatch.setattr(device, "cuda_bf16_supported", lambda: bf16_gpu)
    choice = device.resolve_dtype("auto", device="cuda", model_dtype=lambda: own,
                                  flags=HASWELL)
    assert choice.dtype == expected


def test_native_bf16_reads_cpuinfo_flags(monkeypatch):
    monkeypatch.setattr(device, "cpu_flags", lambda: ZEN4)
    assert device.native_bf16() == "AVX512-BF16"
    monkeypatch.setattr(device, "cpu_flags", lambda: HASWELL)
    assert device.native_bf16() is None


def test_unknown_dtype_is_a_usage_error_naming_the_option():
    with pytest.raises(UsageError, match="--dtype") as err:
        device.resolve_dtype("float64")
    assert "bfloat16" in err.value.remedy


def test_cuda_without_cuda_is_a_usage_error(monkeypatch):
    monkeypatch.setattr(device, "cuda_available", lambda: False)
    with pytest.raises(UsageError, match="CUDA is not available") as err:
        device.resolve_device("cuda")
    assert "--device cpu" in err.value.remedy
    assert device.resolve_device(None) == "cpu" and device.resolve_device("cpu") == "cpu"
    monkeypatch.setattr(device, "cuda_available", lambda: True)
    assert device.resolve_device("cuda") == "cuda" and device.resolve_device(None) == "cuda"


def test_checkpoint_dtype_reads_config(tiny_llama):
    import json

    expected = json.loads((tiny_llama / "config.json").read_text())
    assert checkpoint_dtype(str(tiny_llama)) == (expected.get("torch_dtype")
                                                        or expected.get("dtype"))


@pytest.mark.parametrize("flags,dtype,reason", [
    (frozenset({"avx2", "fma", "f16c"}), "float32", "CPU without native bfloat16"),
    (frozenset({"avx512f", "avx512_bf16"}), "bfloat16", "CPU has AVX512-BF16"),
    (frozenset({"amx_bf16"}), "bfloat16", "CPU has AMX-BF16"),
])
def test_calibration_dtype_auto_follows_native_bf16(flags, dtype, reason):
    choice = device.resolve_calib_dtype("auto", device="cpu", flags=flags)
    assert (choice.dtype, choice.reason) == (dtype, reason)
    assert device.resolve_calib_dtype("auto", device="cuda", flags=flags).dtype == "bfloat16"
    assert device.resolve_calib_dtype("fp32", device="cpu", flags=flags).dtype == "float32"
    assert device.resolve_calib_dtype("bf16", device="cpu", flags=flags).dtype == "bfloat16"


def test_calibration_dtype_rejects_float16_and_typos():
    for bad in ("float16", "bfloat"):
        with pytest.raises(UsageError, match="--calib-dtype") as err:
            device.resolve_calib_dtype(bad)
        assert "auto, bfloat16, float32" in err.value.remedy
