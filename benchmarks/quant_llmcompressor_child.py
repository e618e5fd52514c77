"""Run llm-compressor's GPTQ or AWQ on given token windows (executed in its own venv).

    /work/venvs/llmcompressor/bin/python benchmarks/quant_llmcompressor_child.py \\
        --model DIR --windows windows.json --method gptq --group-size 64 --out OUT

The windows file holds the exact calibration token ids llmctl used, so both tools see the
same data. llm-compressor's AWQ pins intermediates with ``pin_memory()``, which needs an
accelerator; the call is replaced by a no-op here (see shared/FACTS.md).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--windows", required=True)
    parser.add_argument("--method", choices=["gptq", "awq"], required=True)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--n-grid", type=int, default=20)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(args.windows) as handle:
        windows = json.load(handle)
    data = Dataset.from_dict({"input_ids": windows,
                              "attention_mask": [[1] * len(w) for w in windows]})
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
               "group_size": args.group_size}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if args.method == "gptq":
        from llmcompressor.modifiers.quantization import GPTQModifier

        recipe = GPTQModifier(config_groups=groups, ignore=["lm_head"], actorder="static")
    else:
        # 0.14 splits AWQ into a smoothing transform and a QuantizationModifier.
        from llmcompressor.modifiers.quantization import QuantizationModifier
        from llmcompressor.modifiers.transform import AWQModifier
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache.pin_memory = lambda self, *a, **k: self  # no accelerator here
        recipe = [AWQModifier(n_grid=args.n_grid, duo_scaling=True),
                  QuantizationModifier(config_groups=groups, ignore=["lm_head"])]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    start = time.perf_counter()
    oneshot(model=model, dataset=data, recipe=recipe, max_seq_length=len(windows[0]),
            num_calibration_samples=len(windows))
    seconds = time.perf_counter() - start
    model.save_pretrained(args.out, save_compressed=True)
    tokenizer.save_pretrained(args.out)
    with open(f"{args.out}/llmcompressor-run.json", "w") as handle:
        import llmcompressor

        json.dump({"method": args.method, "oneshot_seconds": seconds,
                   "llmcompressor": llmcompressor.__version__,
                   "torch_threads": torch.get_num_threads()}, handle)


if __name__ == "__main__":
    main()
