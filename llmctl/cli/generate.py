"""``llmctl generate``: one completion, on the built-in engine (or transformers)."""

from __future__ import annotations

from typing import Annotated

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import DtypeOpt, JsonOpt, ModelArg, SeedOpt

_BACKENDS = ("engine", "transformers")


def _open_unit_interval(value: float) -> float:
    if not 0.0 < value <= 1.0:  # vLLM's rule; 0 would keep no token at all
        raise typer.BadParameter(f"{value:g} is not in (0, 1]: use 0 < top_p <= 1 "
                                 "(1 turns top-p off)")
    return value


TopP = Annotated[float, typer.Option("--top-p", callback=_open_unit_interval,
                                     help="Nucleus sampling, 0 < top_p <= 1 (1 = off).")]


def register(app: typer.Typer) -> None:
    @app.command()
    @guarded
    def generate(
        model: ModelArg,
        prompt: str = typer.Option(..., "--prompt", "-p", help="The prompt text."),
        chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the chat template."),
        system: str = typer.Option(None, "--system", help="System message (with --chat)."),
        max_tokens: int = typer.Option(64, "--max-tokens", min=1, help="Tokens to generate."),
        temperature: float = typer.Option(0.0, "--temperature", min=0.0,
                                          help="0 = greedy."),
        top_p: TopP = 1.0,
        top_k: int = typer.Option(0, "--top-k", min=0, help="0 = off (engine only)."),
        min_p: float = typer.Option(0.0, "--min-p", min=0.0, max=1.0, help="Engine only."),
        stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
        seed: SeedOpt = 0,
        dtype: DtypeOpt = "auto",
        backend: str = typer.Option("engine", "--backend",
                                    help="engine (built-in, paged KV) | transformers."),
        stream: bool = typer.Option(False, "--stream",
                                    help="Print tokens as they are produced (engine)."),
        speculative: str = typer.Option(None, "--speculative",
                                        help="ngram, or a draft model for speculative decoding."),
        kv_cache_memory: str = typer.Option("256MiB", "--kv-cache-memory",
                                            help="KV cache budget: '512MiB' or a fraction."),
        json_: JsonOpt = False,
    ) -> None:
        """Generate a completion for one prompt."""
        from llmctl.cli.output import Output
        from llmctl.errors import UsageError
        from llmctl.models.loading import load_tokenizer
        from llmctl.models.prompting import encode_prompt
        from llmctl.models.resolve import checkpoint_dtype, resolve_model
        from llmctl.utils.device import default_device, resolve_dtype

        if backend not in _BACKENDS:
            raise UsageError(f"unknown backend {backend!r}", f"use one of: {', '.join(_BACKENDS)}")
        out = Output(json_mode=json_)
        with out.progress("converting model") as update:
            resolved = resolve_model(model, progress=update)
        tokenizer = load_tokenizer(resolved.path)
        ids = encode_prompt(tokenizer, prompt, chat=chat, system=system)
        device = default_device() if backend == "engine" else "cpu"  # hf_generate: CPU
        choice = resolve_dtype(dtype, device=device,
                               model_dtype=lambda: checkpoint_dtype(str(resolved.path)))
        out.status(f"loading {resolved.path.name} ({backend}, {choice.describe()})")
        if backend == "transformers":
            tokens, elapsed, stop_reason = _transformers(resolved.path, tokenizer, ids,
                                                         choice.dtype, max_tokens, temperature,
                                                         top_p, seed)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
        else:
            tokens, text, elapsed, stop_reason = _engine(
                out, str(resolved.path), ids, dtype=choice.dtype, max_tokens=max_tokens,
                temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, stop=stop,
                seed=seed, stream=stream and not json_, speculative=speculative,
                kv_cache_memory=kv_cache_memory)
        data = {"model": resolved.reference, "backend": backend, "dtype": choice.dtype,
                "dtype_reason": choice.reason, "prompt_tokens": len(ids),
                "completion_tokens": len(tokens), "text": text, "seconds": round(elapsed, 3),
                "finish_reason": stop_reason, "token_ids": tokens}

        def render(console) -> None:
            if not (stream and backend == "engine"):
                console.print(text, markup=False)
            out.status(f"{len(tokens)} tokens in {elapsed:.2f} s "
                       f"({len(tokens) / max(elapsed, 1e-9):.1f} tok/s)")

        out.result(data, render)


def _transformers(path, tokenizer, ids, dtype, max_tokens, temperature, top_p, seed):
    import time

    from llmctl.models.hf_generate import hf_generate
    from llmctl.models.loading import load_model

    lm = load_model(path, dtype)
    start = time.perf_counter()
    tokens = hf_generate(lm, tokenizer, ids, max_tokens=max_tokens, temperature=temperature,
                         top_p=top_p, seed=seed)
    return tokens, time.perf_counter() - start, None


def _engine(out, path, ids, *, dtype, max_tokens, temperature, top_p, top_k, min_p, stop, seed,
            stream, speculative, kv_cache_memory):
    import sys
    import time

    from llmctl.serve.core.sampling_params import SamplingParams
    from llmctl.serve.engine.llm import LLM

    spec = None
    if speculative:
        spec = ({"method": "ngram"} if speculative == "ngram"
                else {"method": "draft", "draft_model": speculative})
    max_len = len(ids) + max_tokens
    llm = LLM(path, dtype=dtype, kv_cache_memory=kv_cache_memory, max_num_seqs=1,
              max_model_len=max_len, speculative=spec)
    out.status(llm.engine.kv_plan.describe())
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                            top_k=top_k, min_p=min_p, seed=seed, stop=stop or None)
    start = time.perf_counter()
    final = None
    for result in llm.stream([ids], params):
        final = result
        if stream:
            sys.stdout.write(result.outputs[0].text_delta)
            sys.stdout.flush()
    if stream:
        sys.stdout.write("\n")
    elapsed = time.perf_counter() - start
    if final.error:  # the engine ended this request with its own error
        from llmctl.errors import LlmctlError

        raise LlmctlError(f"generation failed: {final.error}",
                          "rerun with LLMCTL_DEBUG=1 and report it with the command line")
    completion = final.outputs[0]
    return completion.token_ids, completion.text, elapsed, completion.finish_reason
