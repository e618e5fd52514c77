"""Run lm-evaluation-harness tasks on any llmctl candidate, offline.

``--tasks lm_eval:NAME`` with ``--task-dir DIR`` (a directory of task YAMLs, passed
to lm-eval as ``include_path``). Local data: a YAML with ``dataset_path: json`` and
``dataset_kwargs: {data_files: {test: FILE.jsonl}}``. The candidate is wrapped as an
``lm_eval`` ``LM``, so GGUF files and servers work as well as HF checkpoints.
Generation tasks (``generate_until``) are not supported.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

from llmctl.errors import ConfigError, MissingDependencyError
from llmctl.eval.tasks import TaskResult, encode_pair

BATCH = 8  # requests per batched forward (a multiple-choice item's choices arrive together)


def _require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        raise MissingDependencyError("lm_eval tasks need lm-evaluation-harness",
                                     "pip install 'llmctl[lmeval]'")


def make_lm(candidate) -> Any:
    """An ``lm_eval.api.model.LM`` that scores through ``candidate.loglikelihood``."""
    _require_lm_eval()
    from lm_eval.api.model import LM

    tokenizer = candidate.tokenizer

    class LlmctlLM(LM):
        def _prefix(self) -> int:
            return tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id

        def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            pairs = []
            for request in requests:
                context, continuation = request.args
                if context == "":
                    pairs.append(([self._prefix()],
                                  tokenizer(continuation, add_special_tokens=False)["input_ids"]))
                else:
                    pairs.append(encode_pair(tokenizer, context, continuation))
            out = []
            for start in range(0, len(pairs), BATCH):
                out.extend(candidate.loglikelihoods(pairs[start:start + BATCH]))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

            out = []
            for request in requests:
                ids = tokenizer(request.args[0], add_special_tokens=False)["input_ids"]
                total = 0.0
                for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                        token_list=ids, prefix_token=self._prefix(), max_seq_len=2048,
                        context_len=1)):
                    total += candidate.loglikelihood(list(ctx), list(cont))[0]
                out.append(total)
            return out

        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            raise ConfigError("llmctl eval runs log-likelihood tasks only",
                              "pick multiple_choice or loglikelihood tasks")

    return LlmctlLM()


def run_lm_eval(candidate, names: list[str], include_path: Path | None, *, limit: int | None,
                seed: int) -> list[TaskResult]:
    _require_lm_eval()
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    # Indexing lm-eval's thousands of built-in YAMLs takes a minute on 2 cores: look in
    # the user's directory alone first, and add the built-ins only if a name is missing.
    manager = None
    if include_path:
        manager = TaskManager(include_path=str(include_path), include_defaults=False)
        if any(n not in manager.all_tasks for n in names):
            manager = None
    manager = manager or TaskManager(include_path=str(include_path) if include_path else None)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"lm-eval does not know task(s) {', '.join(unknown)}",
                          "pass --task-dir DIR holding their YAML files")
    results = evaluator.simple_evaluate(
        model=make_lm(candidate), tasks=names, task_manager=manager, limit=limit,
        random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
        fewshot_random_seed=seed, bootstrap_iters=0, log_samples=False)
    out = []
    for name in names:
        scores = results["results"][name]
        n = int(results.get("n-samples", {}).get(name, {}).get("effective", 0))
        acc = scores.get("acc,none")
        if acc is None:
            raise ConfigError(f"lm-eval task {name} reports no accuracy",
                              "llmctl gates on multiple_choice tasks (acc, acc_norm)")
        out.append(TaskResult(name, n, float(acc), float(scores.get("acc_norm,none", acc)),
                              "lm_eval", {"lm_eval": {k: v for k, v in scores.items()
                                                      if isinstance(v, (int, float))}}))
    return out
