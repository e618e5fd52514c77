"""``llmctl generate``: a short generation for smoke use."""

from __future__ import annotations

import typer

from llmctl.cli.errors import guarded
from llmctl.cli.options import DtypeOpt, JsonOpt, ModelArg, SeedOpt


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
        top_p: float = typer.Option(1.0, "--top-p", min=0.0, max=1.0),
        seed: SeedOpt = 0,
        dtype: DtypeOpt = "float32",
        json_: JsonOpt = False,
    ) -> None:
        """Generate a completion for one prompt (transformers reference path)."""
        import time

        from llmctl.cli.output import Output
        from llmctl.models.hf_generate import hf_generate
        from llmctl.models.loading import load_model, load_tokenizer
        from llmctl.models.prompting import encode_prompt
        from llmctl.models.resolve import resolve_model

        out = Output(json_mode=json_)
        with out.progress("converting model") as update:
            resolved = resolve_model(model, progress=update)
        tokenizer = load_tokenizer(resolved.path)
        ids = encode_prompt(tokenizer, prompt, chat=chat, system=system)
        out.status(f"loading {resolved.path.name}")
        lm = load_model(resolved.path, dtype)
        start = time.perf_counter()
        tokens = hf_generate(lm, tokenizer, ids, max_tokens=max_tokens, temperature=temperature,
                             top_p=top_p, seed=seed)
        elapsed = time.perf_counter() - start
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        data = {"model": resolved.reference, "prompt_tokens": len(ids),
                "completion_tokens": len(tokens), "text": text, "seconds": round(elapsed, 3),
                "token_ids": tokens}

        def render(console) -> None:
            console.print(text)
            out.status(f"{len(tokens)} tokens in {elapsed:.2f} s "
                       f"({len(tokens) / max(elapsed, 1e-9):.1f} tok/s)")

        out.result(data, render)
