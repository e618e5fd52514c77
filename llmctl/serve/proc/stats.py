"""One stats snapshot for the server from its replicas' snapshots.

How each value merges (counts add, ratios are recomputed from the summed counts, the
recent window's busy time is the longest replica's, ...) is declared by the fields of
:class:`~llmctl.serve.engine.stats.EngineStats` (see there): this only drops the
replicas that have not reported yet.
"""

from __future__ import annotations

from llmctl.serve.engine.stats import EngineStats


def merge_stats(snapshots: list[EngineStats | None]) -> EngineStats:
    """The server's snapshot (one replica's is returned as is; a replica that has sent
    none yet, ``None``, is left out)."""
    return EngineStats.merge([s for s in snapshots if s is not None])
