"""The batch file formats without a model: input lines, output lines, resuming."""

import json

import pytest

from llmctl.errors import UsageError
from llmctl.serve.batch import files as batch_file
from llmctl.serve.batch.files import InputLine, OutputFile, parse_line, survey_input

URLS = ("/v1/chat/completions", "/v1/completions")


def _line(**fields) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def test_a_request_line():
    line = parse_line(3, _line(custom_id="a", method="POST", url="/v1/completions",
                               body={"prompt": "x"}), URLS)
    assert line == InputLine(3, "a", "/v1/completions", {"prompt": "x"})
    assert line.key == "a"


@pytest.mark.parametrize("raw, code, custom_id, words", [
    (b"{not json\n", "invalid_json_line", None, "not valid JSON"),
    (b'{"custom_id": "a", "x": NaN}\n', "invalid_json_line", None, "NaN is not valid JSON"),
    (b"\xff\xfe\n", "invalid_json_line", None, "not valid JSON"),
    (b"[1, 2]\n", "invalid_json_line", None, "not a JSON object"),
    (_line(method="POST", url="/v1/completions", body={}), "invalid_custom_id", None, "null"),
    (_line(custom_id=7, method="POST", url="/v1/completions", body={}), "invalid_custom_id",
     None, "got 7"),
    (_line(custom_id="", method="POST", url="/v1/completions", body={}), "invalid_custom_id",
     None, "non-empty"),
    (_line(custom_id="a", method="GET", url="/v1/completions", body={}), "invalid_method",
     "a", '"GET"'),
    (_line(custom_id="a", method="POST", url="/v1/embeddings", body={}), "invalid_url",
     "a", "/v1/chat/completions, /v1/completions"),
    (_line(custom_id="a", method="POST", url="/v1/completions"), "missing_body", "a",
     "no body"),
])
def test_lines_that_are_no_request(raw, code, custom_id, words):
    line = parse_line(5, raw, URLS)
    assert line.problem.code == code and words in line.problem.message
    assert line.custom_id == custom_id
    # without a custom_id the line number is the line's identity (resume matches on it)
    assert line.key == (custom_id if custom_id is not None else 5)
    out = batch_file.problem_line(line)
    assert out["response"] is None and out["custom_id"] == custom_id
    assert out["error"] == {"code": code, "message": line.problem.message, "line": 5}
    assert out["id"].startswith("batch_req_") and batch_file.failed(out)
    assert batch_file.output_key(out) == line.key


def test_survey_counts_lines_and_refuses_duplicate_ids(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(_line(custom_id="a") + b"\n  \n" + b"{bad\n" + _line(custom_id="b"))
    assert survey_input(path) == ["a", 4, "b"]  # blank lines are skipped, still counted
    path.write_bytes(_line(custom_id="a") + _line(custom_id="b") + _line(custom_id="a"))
    with pytest.raises(UsageError, match="custom_id 'a' is on lines 1 and 3"):
        survey_input(path)


def test_read_input_skips_what_is_done(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"".join(_line(custom_id=c, method="POST", url="/v1/completions",
                                    body={}) for c in "abc") + b"oops\n")
    keys = [line.key for line in batch_file.read_input(path, URLS, {"b", 4})]
    assert keys == ["a", "c"]


def test_response_lines_have_openais_shape():
    ok = batch_file.response_line("a", 200, {"object": "text_completion"})
    assert set(ok) == {"id", "custom_id", "response", "error"} and ok["error"] is None
    assert ok["response"]["status_code"] == 200 and len(ok["response"]["request_id"]) == 32
    assert not batch_file.failed(ok)
    bad = batch_file.response_line("a", 400, {"error": {"message": "m"}})
    assert batch_file.failed(bad) and bad["error"] is None  # an HTTP error: in the response


def test_dumps():
    assert batch_file.dumps({"t": "é"}) == '{"t":"é"}\n'.encode()
    assert batch_file.dumps({"t": "\ud800"}) == b'{"t":"\\ud800"}\n'  # lone surrogate escaped
    with pytest.raises(ValueError):
        batch_file.dumps({"x": float("nan")})


def test_resume_cuts_a_partial_last_line(tmp_path):
    path = tmp_path / "out.jsonl"
    lines = [batch_file.response_line("a", 200, {}), batch_file.response_line("b", 400, {}),
             batch_file.problem_line(InputLine(9, None, problem=batch_file.LineProblem(
                 "invalid_json_line", "line 9 is not valid JSON")))]
    whole = b"".join(batch_file.dumps(line) for line in lines)
    path.write_bytes(whole + b'{"id":"batch_req_x","custom_id":"c","resp')
    out = OutputFile.open(path)
    assert out.written.keys == {"a", "b", 9} and out.written.failed == {"b", 9}
    assert out.written.truncated_bytes == len(b'{"id":"batch_req_x","custom_id":"c","resp')
    assert path.read_bytes() == whole
    out.append([batch_file.dumps(batch_file.response_line("c", 200, {}))])
    out.close()
    got = [json.loads(x) for x in path.read_bytes().splitlines()]
    assert [batch_file.output_key(x) for x in got] == ["a", "b", 9, "c"]


def test_output_that_is_another_file_is_refused(tmp_path):
    path = tmp_path / "notes.jsonl"
    path.write_text('{"prompt": "hello"}\n')
    with pytest.raises(UsageError, match="line 1 of .* is not a batch output line"):
        OutputFile.open(path)
    assert path.read_text() == '{"prompt": "hello"}\n'  # untouched
