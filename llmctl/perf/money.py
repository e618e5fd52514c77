"""Dollars per million tokens and per request, from the machine's price per hour.

A run of ``duration`` seconds on a machine billed ``usd_per_hour`` costs
``usd_per_hour x duration / 3600``. That cost is split between input (prefill) and
output (decode) tokens by each phase's share of the busy time (``prefill_share``: the
engine's own per-phase step seconds when the server reports them, else the client-side
phase times of :mod:`llmctl.perf.utilization`), then divided by the tokens of each kind.
``usd_per_1m_tokens`` puts the whole cost on all tokens, for a single blended price.
"""

from __future__ import annotations


def cost_report(usd_per_hour: float, duration_s: float, *, input_tokens: int,
                output_tokens: int, requests: int, prefill_share: float | None) -> dict:
    """The report's ``cost`` section. ``prefill_share`` in [0, 1], or None when the split
    is unknown (then only the blended prices are given)."""
    if usd_per_hour < 0 or duration_s < 0:
        raise ValueError("cost per hour and duration must be >= 0")
    run_usd = usd_per_hour * duration_s / 3600.0

    def per_million(usd: float, tokens: int) -> float | None:
        return usd / tokens * 1e6 if tokens > 0 else None

    out = {"usd_per_hour": usd_per_hour, "run_usd": run_usd,
           "usd_per_request": run_usd / requests if requests > 0 else None,
           "usd_per_1m_tokens": per_million(run_usd, input_tokens + output_tokens),
           "prefill_share": prefill_share,
           "usd_per_1m_input_tokens": None, "usd_per_1m_output_tokens": None,
           "split": "by each phase's share of the busy time"}
    if prefill_share is not None:
        share = min(max(prefill_share, 0.0), 1.0)
        out["usd_per_1m_input_tokens"] = per_million(run_usd * share, input_tokens)
        out["usd_per_1m_output_tokens"] = per_million(run_usd * (1 - share), output_tokens)
    return out


def flat(cost: dict) -> dict[str, float]:
    """``cost_*`` keys for the report's flat metrics (so ``--gate`` and ``bench compare``
    see them)."""
    keys = ("usd_per_request", "usd_per_1m_tokens", "usd_per_1m_input_tokens",
            "usd_per_1m_output_tokens")
    return {f"cost_{k}": cost[k] for k in keys if cost.get(k) is not None}
