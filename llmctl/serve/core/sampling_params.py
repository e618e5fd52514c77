"""How one request wants its tokens chosen and when it wants to stop.

Field meanings follow vLLM's ``SamplingParams`` (and so OpenAI's request fields), so
the HTTP layer maps requests onto this one-to-one:

- ``temperature == 0`` is greedy; ``top_k`` 0 or -1 disables top-k, ``top_p`` 1 and
  ``min_p`` 0 disable those filters. ``top_p`` must be in (0, 1] (vLLM's rule): 0 would
  keep no token, and is refused rather than read as "off". Floats must be finite.
- ``repetition_penalty`` (HF/CTRL style) divides positive and multiplies negative logits
  of every token seen in the prompt or output; ``presence_penalty`` and
  ``frequency_penalty`` (OpenAI style) subtract ``presence * [count > 0] +
  frequency * count`` over output tokens only.
- ``seed`` makes this request reproducible whatever else shares the batch; with
  ``n > 1`` completion ``i`` uses ``seed + i``. A seed is any 64-bit integer, signed or
  unsigned (``SEED_MIN <= seed <= SEED_MAX``): ``torch.Generator`` seeds are uint64 and a
  negative one stands for ``seed + 2**64``, as in ``torch.manual_seed``; ``seed + i`` wraps
  the same way.
- ``stop`` strings never appear in the returned text (unless
  ``include_stop_str_in_output``); ``stop_token_ids`` and the model's EOS ids end the
  completion too (EOS not with ``ignore_eos``).
- ``logprobs = k`` returns the sampled token's log-probability and the top ``k``
  alternatives, from the model's raw distribution (before penalties, temperature and
  any constraint mask).
- ``prompt_logprobs = k`` does the same for every prompt token after the first (the
  first has no context: its entry is None), as vLLM does. The prompt then bypasses the
  prefix cache (a cached block has no logits to report).
- ``logits_constraint`` (a :class:`~llmctl.serve.core.constraints.ConstraintFactory`)
  restricts every completion to what it allows, e.g. a JSON schema's language.
- ``logit_bias`` (OpenAI's): token id -> a bias in ``[-100, 100]`` added to that token's
  raw logit before anything else (``-100`` all but bans the token, ``+100`` all but forces
  it); at most ``MAX_LOGIT_BIAS_ENTRIES`` tokens. Log-probs stay those of the raw logits.
- ``pooling`` (``"last"`` or ``"mean"``, :data:`~llmctl.serve.core.pooling.POOLING_TYPES`)
  makes the request an embedding: the prompt is prefilled, nothing is sampled, and its
  final output carries the prompt's final hidden states pooled that way
  (:mod:`llmctl.serve.core.pooling`); its KV is freed at once. The sampling fields are
  then unused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from llmctl.errors import UsageError
from llmctl.serve.core.constraints import ConstraintFactory

# torch.Generator.manual_seed takes [-2**63, 2**64 - 1] (int64 or uint64) and nothing else
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1
INT64_MAX = 2**63 - 1  # integer parameters become int64 tensors in the sampler
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's cap on the tokens one request may bias


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    n: int = Field(1, ge=1, le=128)
    max_tokens: int | None = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1, le=INT64_MAX)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    logits_constraint: Any = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    pooling: Literal["last", "mean"] | None = None  # an embedding request (docstring)

    def __init__(self, **data) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            errors = exc.errors()
            problems = "; ".join(
                f"{'.'.join(str(p) for p in err['loc']) or 'sampling'}: {err['msg']}"
                for err in errors)
            unknown = any(err["type"] == "extra_forbidden" for err in errors)
            remedy = (f"allowed fields: {', '.join(type(self).model_fields)}" if unknown
                      else "fix the value named above")
            raise UsageError(f"invalid sampling parameters: {problems}", remedy) from None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, value):
        if value is None:
            return ()
        if isinstance(value, str):
            value = (value,)
        value = tuple(value)
        if any(not isinstance(s, str) or not s for s in value):
            raise ValueError("stop strings must be non-empty strings")
        return value

    @field_validator("logits_constraint")
    @classmethod
    def _constraint(cls, value):
        if value is not None and not isinstance(value, ConstraintFactory):
            raise ValueError("must have a new_constraint() method (a ConstraintFactory)")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value):
        if not value:
            return None  # an empty map biases nothing: the sampler skips the request
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"at most {MAX_LOGIT_BIAS_ENTRIES} tokens, got {len(value)}")
        for token, bias in value.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"bias {bias} for token {token} is outside "
                                 f"[-{LOGIT_BIAS_LIMIT:g}, {LOGIT_BIAS_LIMIT:g}]")
        return value

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_ids(cls, value):
        return () if value is None else tuple(value)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def needs_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)

    @property
    def needs_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
