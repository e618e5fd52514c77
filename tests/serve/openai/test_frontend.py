"""The OpenAI frontend without HTTP: what the server and ``llmctl batch`` share."""

from __future__ import annotations

import subprocess
import sys

import pytest

from llmctl.serve.engine.async_engine import QueueFullError
from llmctl.serve.engine.request_checks import InvalidRequestError
from llmctl.serve.openai.errors import APIError
from llmctl.serve.openai.jobs import Job
from llmctl.serve.openai.submit import submit_all


def test_batch_imports_neither_fastapi_nor_the_http_layer():
    code = ("import sys\nimport llmctl.serve.batch.runner\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette'}),"
            " [m for m in sys.modules if m.startswith('llmctl.serve.api')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[] []"


def _jobs(count: int) -> list[Job]:
    return [Job(f"cmpl-x-{i}", [1, 2], i) for i in range(count)]


def test_submit_all_is_all_or_none():
    submitted, aborted, refunded = [], [], []

    def submit(job: Job):
        if len(submitted) == 2:
            raise QueueFullError("full")
        submitted.append(job.request_id)
        return "stream"

    jobs = _jobs(3)
    with pytest.raises(APIError) as info:
        submit_all(jobs, submit, aborted.append, "tiny", on_refused=lambda: refunded.append(1))
    assert info.value.status == 429 and info.value.headers == {"Retry-After": "1"}
    assert aborted == submitted == ["cmpl-x-0", "cmpl-x-1"] and refunded == [1]


def test_an_engine_check_is_a_400_naming_its_param():
    def submit(job: Job):
        raise InvalidRequestError("token id 9 is outside the vocabulary (0..8)", None, "prompt")

    with pytest.raises(APIError) as info:
        submit_all(_jobs(1), submit, lambda rid: None, "tiny")
    assert info.value.status == 400 and info.value.param == "prompt"


def test_an_unexpected_error_is_raised_as_it_is():
    def submit(job: Job):
        raise KeyError("bug")

    with pytest.raises(KeyError):
        submit_all(_jobs(2), submit, lambda rid: None, "tiny")
