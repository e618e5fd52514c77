"""A server whose engine processes started and whose next assembly step refuses (a
reasoning parser refusing the tokenizer) ends those processes: `llmctl serve` printed the
error and then hung on them."""

from __future__ import annotations

import time

import psutil
import pytest

from llmctl.errors import LlmctlError


def test_a_refusal_after_the_engine_started_ends_its_processes(tiny_llama):
    from llmctl.serve.launch.assemble import ServeOptions, build_server
    from llmctl.serve.launch.startup import ServeSettings

    me = psutil.Process()

    def engines() -> list:
        # the engine replicas; multiprocessing's forkserver and resource tracker (our
        # direct children) stay up for later spawns and are not the engine's, but what
        # the forkserver forked (its children, with its command line) is
        helpers = {p.pid for p in me.children()
                   if any(k in " ".join(p.cmdline()) for k in ("resource_tracker",
                                                                "forkserver"))}
        out = []
        for p in me.children(recursive=True):
            try:
                if p.pid not in helpers and p.pid not in before \
                        and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                continue
        return out

    before: set[int] = set()
    before = {p.pid for p in engines()}
    opts = ServeOptions(
        ServeSettings(model=str(tiny_llama), engine_process=True, reasoning_parser="harmony"),
        engine_kwargs={"kv_cache_memory": "16MiB", "max_num_seqs": 4})
    with pytest.raises(LlmctlError, match="harmony") as caught:
        build_server(opts)
    assert "\n" not in str(caught.value.args[0])
    deadline = time.monotonic() + 30
    while (left := engines()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [p.cmdline()[:4] for p in left]
