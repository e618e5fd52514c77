"""Who is asking and what they may still spend: the request path's calls for tenants.

1. :meth:`Tenancy.authenticate` turns the ``Authorization`` header into a
   :class:`~llmctl.serve.api.tenancy.keys.Tenant` (401 otherwise); :meth:`check_model` refuses
   a key issued for another model or LoRA adapter (403); :meth:`check_admin` refuses
   the admin routes to tenants not marked ``admin`` (403); :meth:`max_tokens_cap` refuses a ``max_tokens``
   over the tenant's per-request cap (400, as OpenAI and vLLM answer a max_tokens the
   model cannot honour: the request itself is wrong, waiting will not help) and
   otherwise caps an unset one.
2. :meth:`admit` reserves the request's worst case from the tenant's limits
   (:mod:`llmctl.serve.api.tenancy.ratelimit`): a 429 in OpenAI's shape with its headers, or a
   :class:`Grant` whose headers go on the response and which the request settles to
   what it consumed (prompt + generated) when it ends, whichever way it ends.
3. :meth:`reload` (SIGHUP) builds a new table from the auth file and swaps one
   reference: requests in flight keep their tenant and grant; usage is kept by tenant
   name; a bad file keeps the old table and logs one line.

Without keys (no ``--api-key``, no ``--auth-file``) every call passes and grants are
empty. Keys are never logged; only their tenants' names are.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmctl.serve.api.tenancy.keys import UNKNOWN, Tenant, TenantTable
from llmctl.serve.api.tenancy.ratelimit import KINDS, Gauge, RateLimiter, Refusal, Reservation
from llmctl.serve.openai import errors

log = logging.getLogger("llmctl.serve")

# Rejection reasons (a metric label): the auth checks, then one per limit kind.
REASONS = ("unauthorized", "model_not_allowed", "not_admin", "max_tokens", *KINDS)

# Header names per limit: OpenAI's x-ratelimit-{limit,remaining,reset}-requests, and
# for the limits OpenAI has no header of its own, the same pattern with the limit's name.
_SUFFIX = {"requests": "requests", "input_tokens": "input-tokens",
           "output_tokens": "output-tokens", "tokens_day": "tokens-day"}
_MINUTE_TOKENS = ("input_tokens", "output_tokens")


def go_duration(seconds: float) -> str:
    """Seconds as OpenAI writes its reset headers (Go's Duration: ``12ms``, ``1.5s``,
    ``6m0s``, ``1h2m3s``)."""
    ms = max(round(seconds * 1000), 0)
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    secs = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{secs}"
    return f"{minutes}m{secs}" if minutes else secs


def rate_limit_headers(gauges: tuple[Gauge, ...]) -> dict[str, str]:
    """Limit, remaining and reset for each of the tenant's limits. OpenAI's
    ``x-ratelimit-*-tokens`` (one tokens-per-minute limit there) show the per-minute
    token limit with the fewest tokens left: the one a client's next request meets
    first."""
    headers: dict[str, str] = {}
    for g in gauges:
        headers.update(_triple(_SUFFIX[g.kind], g))
    minute = [g for g in gauges if g.kind in _MINUTE_TOKENS]
    if minute:
        headers.update(_triple("tokens", min(minute, key=lambda g: g.remaining)))
    return headers


def _triple(suffix: str, g: Gauge) -> dict[str, str]:
    return {f"x-ratelimit-limit-{suffix}": str(g.limit),
            f"x-ratelimit-remaining-{suffix}": str(g.remaining),
            f"x-ratelimit-reset-{suffix}": go_duration(g.reset)}


def refusal_error(tenant: str, refusal: Refusal, headers: dict[str, str]) -> errors.APIError:
    """OpenAI's wording ("Rate limit reached for ... on tokens per min (TPM): Limit L,
    Used U, Requested R. Please try again in 1.5s."), with ``retry-after`` in whole
    seconds (RFC 9110) and ``retry-after-ms`` (openai-python prefers it). A request over
    the limit itself is refused with ``x-should-retry: false``: waiting cannot help."""
    kind = KINDS[refusal.kind]
    headers = dict(headers)
    if refusal.retry_after is None:
        headers["x-should-retry"] = "false"
        message = (f"Request too large for tenant {tenant!r} on {kind.what}: Limit "
                   f"{refusal.limit}, Requested {refusal.requested}. Lower max_tokens or "
                   "shorten the prompt.")
    else:
        wait = refusal.retry_after
        headers["retry-after"] = str(max(math.ceil(wait), 1))
        headers["retry-after-ms"] = str(max(math.ceil(wait * 1000), 1))
        message = (f"Rate limit reached for tenant {tenant!r} on {kind.what}: Limit "
                   f"{refusal.limit}, Used {refusal.used}, Requested {refusal.requested}. "
                   f"Please try again in {go_duration(wait)}.")
    return errors.rate_limited(message, kind.unit, headers)


@dataclass
class Grant:
    """A request's admission: who it runs as, the headers its response carries, and
    the reservation it settles once when it ends."""

    tenant: Tenant | None = None
    reservation: Reservation | None = None
    headers: dict[str, str] = field(default_factory=dict)
    _tenancy: Tenancy | None = None

    @property
    def who(self) -> dict[str, str]:
        """``AsyncEngine.submit``'s tenant and priority_class (none without keys)."""
        if self.tenant is None:
            return {}
        return {"tenant": self.tenant.name, "priority_class": self.tenant.priority_class}

    def settle(self, prompt_tokens: int, generated_tokens: int) -> None:
        """The request ended (finished, stopped, aborted, failed): charge what it used."""
        if self.reservation is None or self.reservation.settled or self._tenancy is None:
            return
        used = {"requests": 1, "input_tokens": prompt_tokens,
                "output_tokens": generated_tokens,
                "tokens_day": prompt_tokens + generated_tokens}
        self._tenancy.limiter.settle(self.reservation, used)
        self._tenancy.metrics.tenant_consumed(self.reservation.tenant, prompt_tokens,
                                              generated_tokens)

    def refund(self) -> None:
        """The request never reached the engine: it costs nothing."""
        if self.reservation is not None and self._tenancy is not None:
            self._tenancy.limiter.settle(self.reservation, {})


class Tenancy:
    def __init__(self, table: TenantTable | None, metrics, served_names: tuple[str, ...],
                 auth_file: str | None = None, clock: Callable[[], float] = time.time) -> None:
        self.table = table
        self.metrics = metrics  # ServerMetrics
        self.served_names = served_names
        self.auth_file = auth_file
        self.limiter = RateLimiter(clock)
        self._announce(table)

    @property
    def enabled(self) -> bool:
        return self.table is not None

    def _announce(self, table: TenantTable | None) -> None:
        for name in (table.tenants if table else ()):
            self.metrics.tenant_known(name)

    def _reject(self, tenant: str, reason: str, exc: errors.APIError) -> errors.APIError:
        self.metrics.tenant_rejected(tenant, reason)
        return exc

    # --- the request path ------------------------------------------------------------
    def authenticate(self, authorization: str | None) -> Tenant | None:
        """The key's tenant; None when the server has no keys; 401 otherwise."""
        table = self.table  # one read: a reload mid-call swaps the whole table
        if table is None:
            return None
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        tenant = table.lookup(_raw(key)) if scheme.lower() == "bearer" and key else None
        if tenant is None:
            raise self._reject(UNKNOWN, "unauthorized", errors.unauthorized())
        return tenant

    def may_use_model(self, tenant: Tenant | None, model: str) -> bool:
        """The base model under any of its names, or a LoRA adapter (any other name a
        request may send) listed by its own name."""
        if tenant is None:
            return True
        if model in self.served_names:
            return tenant.may_use(self.served_names)
        return tenant.may_use_adapter(model)

    def check_model(self, tenant: Tenant | None, model: str) -> None:
        if not self.may_use_model(tenant, model):
            raise self._reject(tenant.name, "model_not_allowed", errors.model_forbidden(model))

    def check_admin(self, tenant: Tenant | None) -> None:
        """Admin routes (LoRA load/unload): a tenant marked ``admin`` in the auth file;
        without keys, anyone (the route's own switch guards it)."""
        if self.enabled and (tenant is None or not tenant.admin):
            name = tenant.name if tenant is not None else UNKNOWN
            raise self._reject(name, "not_admin", errors.APIError(
                403, "this API key may not load or unload LoRA adapters; use a key whose "
                "tenant has admin: true in --auth-file", "permission_error",
                code="admin_required"))

    def allowed_models(self, tenant: Tenant | None) -> tuple[str, ...]:
        """The served names ``/v1/models`` lists to this tenant."""
        return self.served_names if tenant is None or tenant.may_use(self.served_names) \
            else ()

    def max_tokens_cap(self, tenant: Tenant | None, requested: int | None,
                       param: str) -> int | None:
        """The tenant's per-request cap (None: none); 400 when ``requested`` exceeds it."""
        cap = None if tenant is None else tenant.limits.max_tokens_per_request
        if cap is not None and requested is not None and requested > cap:
            raise self._reject(tenant.name, "max_tokens", errors.bad_request(
                f"{param} is {requested}; this API key allows at most {cap} per request",
                param))
        return cap

    def admit(self, tenant: Tenant | None, prompt_tokens: int, output_tokens: int) -> Grant:
        """Reserve one request, its prompt and ``output_tokens`` (max_tokens x choices),
        or raise 429."""
        if tenant is None:
            return Grant()
        need = {"requests": 1, "input_tokens": prompt_tokens, "output_tokens": output_tokens,
                "tokens_day": prompt_tokens + output_tokens}
        decision = self.limiter.admit(tenant.name, tenant.limits, need)
        headers = rate_limit_headers(decision.gauges)
        if decision.refusal is not None:
            raise self._reject(tenant.name, decision.refusal.kind,
                               refusal_error(tenant.name, decision.refusal, headers))
        self.metrics.tenant_admitted(tenant.name)
        return Grant(tenant, decision.reservation, headers, self)

    # --- SIGHUP ----------------------------------------------------------------------
    def reload(self) -> bool:
        """Re-read ``--auth-file``; True when the new table is in use."""
        from llmctl.errors import LlmctlError

        if self.auth_file is None:
            log.warning("SIGHUP: no --auth-file to reload")
            return False
        try:
            table = TenantTable.load(self.auth_file)
        except LlmctlError as exc:
            log.error("SIGHUP: %s; keeping the previous keys", exc.message)
            return False
        self._announce(table)
        self.table = table
        log.info("SIGHUP: reloaded %s: %d tenants, %d keys", self.auth_file,
                 len(table.tenants), table.num_keys)
        return True


def _raw(key: str) -> bytes:
    """The header's bytes as the client sent them (ASGI servers decode headers as
    latin-1), so a non-ASCII key hashes as ``printf %s KEY | sha256sum`` does."""
    try:
        return key.encode("latin-1")
    except UnicodeEncodeError:
        return key.encode()
