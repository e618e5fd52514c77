"""/v1/embeddings without HTTP (llmctl.serve.openai.embeddings): the vector cut to
``dimensions`` and normalised, the base64 the OpenAI SDK decodes, the request's shapes,
and a response assembled from engine outputs."""

from __future__ import annotations

import base64
import math
from types import SimpleNamespace

import numpy as np
import pytest

from llmctl.serve.openai.embeddings import (
    OpenAIEmbeddings,
    as_float32,
    encode_base64,
    finish_vector,
)
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.models import OpenAIModels, ServedModel
from llmctl.serve.openai.protocol import EmbeddingRequest
from llmctl.serve.openai.validation import validated

VEC = [3.0, 4.0, 12.0, -0.1]


def test_finish_vector_normalises_then_rounds_to_float32():
    out = finish_vector(VEC)
    norm = math.sqrt(sum(x * x for x in VEC))
    assert out == as_float32([x / norm for x in VEC])
    assert abs(math.fsum(x * x for x in out) - 1) < 1e-6


def test_dimensions_cut_before_normalising():
    assert finish_vector(VEC, 2) == as_float32([0.6, 0.8])
    assert finish_vector(VEC, 2, normalize=False) == [3.0, 4.0]


def test_a_zero_vector_stays_zero():
    assert finish_vector([0.0, 0.0]) == [0.0, 0.0]


def test_base64_is_what_the_openai_sdk_decodes():
    values = finish_vector(VEC)
    # openai-python: np.frombuffer(base64.b64decode(data), dtype="float32").tolist()
    decoded = np.frombuffer(base64.b64decode(encode_base64(values)), dtype="float32").tolist()
    assert decoded == values


@pytest.mark.parametrize("value", ["a", ["a", "b"], [1, 2], [[1], [2, 3]]])
def test_input_shapes(value):
    req = EmbeddingRequest.model_validate({"input": value})
    assert req.inputs() == ([value] if isinstance(value, str) or isinstance(value[0], int)
                            else value)
    assert req.encoding_format == "float" and req.stream is False


@pytest.mark.parametrize(("body", "param"), [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": [[1], []]}, "input"),
    ({"input": [True]}, "input"), ({"input": ["a", 1]}, "input"),
    ({"input": ["a"] * 2049}, "input"), ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "encoding_format": "binary"}, "encoding_format"),
    ({"input": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
])
def test_malformed_requests_name_their_param(body, param):
    with pytest.raises(APIError) as info:
        validated(body, EmbeddingRequest)
    assert info.value.status == 400 and info.value.param == param


class _Prompts:
    """What OpenAIEmbeddings reads of Prompts: a one-token-per-character tokenizer."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.checked: list[int] = []

    def check_chars(self, chars: int, param: str) -> None:
        self.checked.append(chars)

    def tokenize(self, text: str, add_special_tokens: bool = True, param: str = "prompt"):
        return ([1] if add_special_tokens else []) + [ord(c) % 50 + 2 for c in text]


@pytest.fixture
def serving():
    model = ServedModel("tiny", max_model_len=8, vocab_size=64, hidden_size=4)
    return OpenAIEmbeddings(_Prompts(model), OpenAIModels(model), pooling="mean")


def test_encode_checks_every_input_before_any_is_submitted(serving):
    assert serving.encode(EmbeddingRequest(input=["ab", "c"])) == [[1, 49, 50], [1, 51]]
    for body, param in (({"input": ["ab", "x" * 8]}, "input"),  # 9 tokens > 8
                        ({"input": [[1, 64]]}, "input"),  # outside the vocabulary
                        ({"input": "a", "dimensions": 5}, "dimensions")):
        with pytest.raises(APIError) as info:
            serving.encode(EmbeddingRequest.model_validate(body))
        assert info.value.status == 400 and info.value.param == param
    assert serving.encode(EmbeddingRequest(input=[[1] * 8])) == [[1] * 8]  # fills the context


def test_jobs_pool_and_sample_nothing(serving):
    req = EmbeddingRequest(input=[[1, 2], [3]])
    jobs, params = serving.jobs(req, [[1, 2], [3]])
    assert params.pooling == "mean"
    assert [j.choice_offset for j in jobs] == [0, 1]
    assert jobs[0].request_id.startswith("embd-") and jobs[0].lora is None


def _out(vector, finished=True):
    return SimpleNamespace(finished=finished, embedding=vector if finished else None)


def test_assembly_body_in_input_order(serving):
    req = EmbeddingRequest(input=[[1, 2], [3]], dimensions=2, encoding_format="base64",
                           use_activation=False)
    jobs, _ = serving.jobs(req, [[1, 2], [3]])
    assembly = serving.assembly(req, jobs)
    assembly.collect(jobs[1], _out([5.0, 6.0, 7.0, 8.0]))
    assembly.collect(jobs[0], _out(None, finished=False))
    assembly.collect(jobs[0], _out([1.0, 2.0, 3.0, 4.0]))
    body = assembly.body()
    assert body["object"] == "list" and body["model"] == "tiny"
    assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3, "completion_tokens": 0}
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert body["data"][1] == {"index": 1, "object": "embedding",
                               "embedding": encode_base64([5.0, 6.0])}


def test_an_aborted_job_has_no_body(serving):
    req = EmbeddingRequest(input="a")
    jobs, _ = serving.jobs(req, [[1]])
    with pytest.raises(APIError) as info:
        serving.assembly(req, jobs).body()
    assert info.value.status == 500
