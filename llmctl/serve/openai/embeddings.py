"""``/v1/embeddings`` without HTTP: inputs as pooling engine requests (prefill only,
:mod:`llmctl.serve.core.pooling`), and their pooled vectors as OpenAI's response.

The engine returns each prompt's pooled final hidden state as it is; here it is cut to
``dimensions`` first and then L2-normalised (so a shortened vector is a unit vector
again, as OpenAI's ``dimensions`` and vLLM's Matryoshka truncation give), unless
normalising is off (``--no-embed-normalize``, or a request's ``use_activation: false``).
Values are float32 in both encodings: ``base64`` is the little-endian float32 bytes
the OpenAI SDK decodes (``numpy.frombuffer(..., dtype="float32")``), ``float`` the same
values as JSON numbers, so the two decode to the same vector.
"""

from __future__ import annotations

import base64
import math
import struct
import time
import uuid
from typing import Any

from llmctl.serve.core.pooling import POOLING_TYPES
from llmctl.serve.core.sampling_params import SamplingParams
from llmctl.serve.engine.request_checks import (
    ContextLengthError,
    InvalidRequestError,
    check_embedding_fits,
    check_prompt_ids,
)
from llmctl.serve.openai import errors
from llmctl.serve.openai.jobs import Job, response_id
from llmctl.serve.openai.models import OpenAIModels
from llmctl.serve.openai.prompts import Prompts
from llmctl.serve.openai.protocol import EmbeddingRequest

NORM_EPS = 1e-12  # torch.nn.functional.normalize's floor: a zero vector stays zero


def as_float32(values: list[float]) -> list[float]:
    """``values`` rounded to float32 (what the base64 encoding carries)."""
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def finish_vector(vector: list[float], dimensions: int | None = None,
                  normalize: bool = True) -> list[float]:
    """The first ``dimensions`` values (all when None), L2-normalised when ``normalize``,
    rounded to float32; the sum is taken in float64."""
    cut = vector[:dimensions] if dimensions is not None else list(vector)
    if normalize:
        norm = max(math.sqrt(math.fsum(x * x for x in cut)), NORM_EPS)
        cut = [x / norm for x in cut]
    return as_float32(cut)


def encode_base64(values: list[float]) -> str:
    """Little-endian float32 bytes, base64: what the OpenAI SDK decodes."""
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")


class OpenAIEmbeddings:
    kind = "embedding"  # the response shape

    def __init__(self, prompts: Prompts, models: OpenAIModels, pooling: str = "last",
                 normalize: bool = True) -> None:
        """``pooling``: the server's (``--pooling`` or the model's own); ``normalize``:
        the default a request's ``use_activation`` overrides."""
        if pooling not in POOLING_TYPES:
            raise ValueError(f"unknown pooling {pooling!r}")
        self.prompts = prompts
        self.models = models
        self.pooling = pooling
        self.normalize = normalize

    def check_dimensions(self, req: EmbeddingRequest) -> None:
        size = self.models.model.hidden_size  # None: unknown, checked against each vector
        if req.dimensions is not None and size is not None and req.dimensions > size:
            raise errors.bad_request(
                f"dimensions: {req.dimensions} is more than this model's embedding size of "
                f"{size}; allowed: 1 <= dimensions <= {size}", "dimensions")

    def encode(self, req: EmbeddingRequest) -> list[list[int]]:
        """Each input as token ids, every one checked before any is submitted: in the
        vocabulary, and within the context (an embedding may fill it)."""
        self.check_dimensions(req)
        prompts = self.prompts
        for x in req.inputs():  # all of them before any is tokenized
            if isinstance(x, str):
                prompts.check_chars(len(x), "input")
        out = []
        for x in req.inputs():
            ids = prompts.tokenize(x, req.add_special_tokens, "input") \
                if isinstance(x, str) else list(x)
            try:
                check_prompt_ids(ids, prompts.model.vocab_size, "input")
                check_embedding_fits(len(ids), prompts.model.max_model_len, "input")
            except (InvalidRequestError, ContextLengthError) as exc:
                raise errors.bad_request(exc.message, exc.param) from None
            out.append(ids)
        return out

    def jobs(self, req: EmbeddingRequest, prompts: list[list[int]]
             ) -> tuple[list[Job], SamplingParams]:
        """One pooling engine request per input (index ``i`` feeds ``data[i]``)."""
        rid = f"embd-{uuid.uuid4().hex}"
        params = SamplingParams(pooling=self.pooling, max_tokens=1)  # nothing is sampled
        lora = self.models.adapter_of(req.model)
        return [Job(f"{rid}-{i}", ids, i, lora=lora) for i, ids in enumerate(prompts)], params

    def assembly(self, req: EmbeddingRequest, jobs: list[Job]) -> EmbeddingAssembly:
        return EmbeddingAssembly(self, req, jobs)

    def item(self, req: EmbeddingRequest, index: int, vector: list[float]) -> dict[str, Any]:
        """One ``data`` entry."""
        if req.dimensions is not None and req.dimensions > len(vector):  # size unknown
            raise errors.bad_request(
                f"dimensions: {req.dimensions} is more than this model's embedding size of "
                f"{len(vector)}", "dimensions")
        normalize = self.normalize if req.use_activation is None else req.use_activation
        values = finish_vector(vector, req.dimensions, normalize)
        embedding: list[float] | str = encode_base64(values) \
            if req.encoding_format == "base64" else values
        return {"index": index, "object": "embedding", "embedding": embedding}


class EmbeddingAssembly:
    """One response put together from its engine requests' final outputs (the server's
    and ``llmctl batch``'s, as :class:`~llmctl.serve.openai.responses.Assembly` is)."""

    def __init__(self, serving: OpenAIEmbeddings, req: EmbeddingRequest,
                 jobs: list[Job]) -> None:
        self.serving = serving
        self.kind = serving.kind
        self.req = req
        self.jobs = jobs
        self.vectors: dict[int, list[float]] = {}

    def collect(self, job: Job, out) -> None:
        """Take ``out`` (an output of ``job``); only a final one carries the vector."""
        if out.finished and out.embedding is not None:
            self.vectors[job.choice_offset] = out.embedding

    def body(self) -> dict[str, Any]:
        missing = [job.request_id for job in self.jobs if job.choice_offset not in self.vectors]
        if missing:  # aborted in the engine (finish reason "abort"), not failed
            raise errors.internal(f"no embedding came back for {', '.join(missing)}")
        tokens = sum(len(job.prompt_ids) for job in self.jobs)
        serving = self.serving
        return {"id": response_id(self.jobs), "object": "list", "created": int(time.time()),
                "model": serving.models.response_model(self.jobs),
                "data": [serving.item(self.req, i, self.vectors[i])
                         for i in sorted(self.vectors)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens,
                          "completion_tokens": 0}}
