"""API keys -> tenants: the ``--auth-file`` YAML, typed, and the table built from it.

The file holds only SHA-256 digests of keys, never keys::

    tenants:
      acme:
        priority_class: interactive      # interactive | standard (default) | batch
        requests_per_minute: 60          # every limit is optional: absent = no limit
        input_tokens_per_minute: 20000
        output_tokens_per_minute: 5000
        tokens_per_day: 1000000          # prompt + generated, per UTC calendar day
        max_tokens_per_request: 512      # a larger max_tokens is a 400
        models: [smollm2-135m, sql-lora] # optional: the served names and LoRA adapters
                                         # this tenant may use (an adapter by its name)
        admin: true                      # optional: may load and unload LoRA adapters
                                         # (--enable-lora-runtime-updates); default false
    keys:
      - key_sha256: 9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08
        tenant: acme

A digest is ``printf %s "$KEY" | sha256sum`` (or ``python -c "import hashlib, sys;
print(hashlib.sha256(sys.argv[1].encode()).hexdigest())" "$KEY"``). A tenant may have
several keys (rotation). ``--api-key KEY`` is the one-key shortcut: tenant ``default``,
no limits, admin (the one key is the operator's).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PositiveInt,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from llmctl.errors import UsageError

# The classes the scheduler orders by (its table names them too; keep the two in step).
PRIORITY_CLASSES = ("interactive", "standard", "batch")
PriorityClass = Literal["interactive", "standard", "batch"]
DEFAULT_CLASS: PriorityClass = "standard"
# Metric label for requests whose key matched no tenant: never a tenant's own name.
UNKNOWN = "unknown"
SINGLE_KEY_TENANT = "default"

HASH_HINT = "store the key's SHA-256: printf %s \"$KEY\" | sha256sum"
_FILE_SHAPE = ("the file is tenants: {NAME: {priority_class, requests_per_minute, "
               "input_tokens_per_minute, output_tokens_per_minute, tokens_per_day, "
               "max_tokens_per_request, models, admin}} and keys: [{key_sha256, tenant}]")

# Tenant names become metric labels: short and plain.
TenantName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")]


def hash_key(key: str | bytes) -> str:
    """The hex SHA-256 the auth file stores for ``key`` (str keys as UTF-8)."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Strict):
    requests_per_minute: PositiveInt | None = None
    input_tokens_per_minute: PositiveInt | None = None
    output_tokens_per_minute: PositiveInt | None = None
    tokens_per_day: PositiveInt | None = None
    max_tokens_per_request: PositiveInt | None = None


class TenantSpec(Limits):
    priority_class: PriorityClass = DEFAULT_CLASS
    models: list[str] | None = Field(None, min_length=1)
    admin: bool = False


class KeyEntry(_Strict):
    key_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")]
    tenant: str

    @model_validator(mode="before")
    @classmethod
    def _no_plain_keys(cls, data):
        if isinstance(data, dict) and "key" in data:
            raise ValueError("plain keys are not accepted: store the key's SHA-256 as "
                             "key_sha256")
        return data

    @field_validator("key_sha256")
    @classmethod
    def _lower(cls, value: str) -> str:
        return value.lower()


class AuthFile(_Strict):
    tenants: dict[TenantName, TenantSpec] = Field(min_length=1)
    keys: list[KeyEntry] = Field(min_length=1)

    @model_validator(mode="after")
    def _consistent(self) -> AuthFile:
        if UNKNOWN in self.tenants:
            raise ValueError(f"the tenant name {UNKNOWN!r} is reserved (unknown keys' "
                             "metric label); rename it")
        seen: set[str] = set()
        for i, entry in enumerate(self.keys):
            if entry.tenant not in self.tenants:
                raise ValueError(f"keys[{i}] names the tenant {entry.tenant!r}, which is not "
                                 f"under tenants (known: {', '.join(sorted(self.tenants))})")
            if entry.key_sha256 in seen:
                raise ValueError(f"keys[{i}] repeats an earlier key_sha256; each key belongs "
                                 "to one tenant")
            seen.add(entry.key_sha256)
        return self


@dataclass(frozen=True)
class Tenant:
    name: str
    priority_class: str
    limits: Limits
    models: frozenset[str] | None = None  # None: every model and adapter
    admin: bool = False  # may load and unload LoRA adapters

    def may_use(self, served_names: tuple[str, ...]) -> bool:
        """One server serves one model under several names; a tenant listing any of them
        may use it."""
        return self.models is None or not self.models.isdisjoint(served_names)

    def may_use_adapter(self, name: str) -> bool:
        """A LoRA adapter is a model of its own: listed by its name, or every model."""
        return self.models is None or name in self.models


class TenantTable:
    """Key digests -> tenants; built whole, never changed (a reload builds a new one)."""

    def __init__(self, tenants: dict[str, Tenant], keys: list[tuple[str, str]]) -> None:
        self.tenants = tenants
        self._keys = tuple((digest, tenants[name]) for digest, name in keys)

    @classmethod
    def from_spec(cls, spec: AuthFile) -> TenantTable:
        tenants = {name: Tenant(name, t.priority_class,
                                Limits(**t.model_dump(include=set(Limits.model_fields))),
                                frozenset(t.models) if t.models else None, t.admin)
                   for name, t in spec.tenants.items()}
        return cls(tenants, [(k.key_sha256, k.tenant) for k in spec.keys])

    @classmethod
    def single_key(cls, key: str) -> TenantTable:
        """``--api-key``: one tenant, no limits."""
        tenant = Tenant(SINGLE_KEY_TENANT, DEFAULT_CLASS, Limits(), admin=True)
        return cls({tenant.name: tenant}, [(hash_key(key), tenant.name)])

    @classmethod
    def load(cls, path: str | Path) -> TenantTable:
        """Read and check an auth file; a UsageError of one line naming the problem
        (never a value from the file: it could be a key pasted by mistake)."""
        import yaml

        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise UsageError(f"cannot read --auth-file {path}: {reason}",
                             "pass a readable YAML file") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(exc, "problem", None) or "cannot be parsed"
            raise UsageError(f"--auth-file {path} is not valid YAML{where}: {problem}",
                             _FILE_SHAPE) from None
        try:
            spec = AuthFile.model_validate(data)
        except ValidationError as exc:
            raise UsageError(f"--auth-file {path}: {_problem(exc)}", _remedy(exc)) from None
        return cls.from_spec(spec)

    def lookup(self, key: str | bytes) -> Tenant | None:
        """The tenant of ``key``, or None. Every stored digest is compared in constant
        time, without stopping at a match: how long this takes says nothing about which
        keys exist (a few thousand keys cost well under a millisecond)."""
        digest = hash_key(key)
        found = None
        for stored, tenant in self._keys:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    @property
    def num_keys(self) -> int:
        return len(self._keys)


def _problem(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown field (a typo?)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return (f"{loc}: {msg}" if loc else msg) + more


def _remedy(exc: ValidationError) -> str:
    loc = exc.errors()[0]["loc"]
    return HASH_HINT if loc[:1] == ("keys",) and len(loc) >= 2 else _FILE_SHAPE
