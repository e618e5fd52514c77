"""Workload builders: token lengths with the model's tokenizer, loaders, seeding."""

import json
from collections import Counter

import pytest

from llmctl.bench.datasets import (
    LONG_CONTEXT_QUESTION,
    DatasetSpec,
    build_dataset,
    fingerprint,
    join_prefix,
)
from llmctl.errors import ConfigError, UsageError


@pytest.fixture(scope="module")
def tok(tiny_llama):
    from llmctl.bench.target import model_info

    return model_info(str(tiny_llama), None).tokenizer


def count(tok, text):
    return len(tok(text, add_special_tokens=False)["input_ids"])


def test_random_fixed_lengths_are_exact(tok):
    samples = build_dataset(DatasetSpec(num_prompts=20, input_len=48, output_len=7), tok)
    assert len(samples) == 20
    for s in samples:
        assert s.prompt_len == count(tok, s.prompt)  # recorded length is the real one
        assert s.output_len == 7
    assert sum(s.prompt_len == 48 for s in samples) >= 18
    assert len({s.prompt for s in samples}) == 20


def test_random_normal_lengths(tok):
    spec = DatasetSpec(num_prompts=200, input_len=40, input_len_std=8, output_len=30,
                       output_len_std=5, seed=1)
    samples = build_dataset(spec, tok)
    ins = [s.prompt_len for s in samples]
    outs = [s.output_len for s in samples]
    assert sum(ins) / 200 == pytest.approx(40, abs=2)
    assert sum(outs) / 200 == pytest.approx(30, abs=1.5)
    assert len(set(ins)) > 10 and min(outs) >= 1


def test_same_seed_same_prompts(tok):
    spec = DatasetSpec(num_prompts=10, input_len=16, input_len_std=4, output_len=8, seed=5)
    a, b = build_dataset(spec, tok), build_dataset(spec, tok)
    assert a == b and fingerprint(a) == fingerprint(b)
    other = build_dataset(spec.model_copy(update={"seed": 6}), tok)
    assert fingerprint(other) != fingerprint(a)


def test_sharegpt(tmp_path, tok):
    long_reply = "a reply with a good number of words in it " * 3
    data = [
        {"conversations": [{"from": "human", "value": "what is a file object in python?"},
                           {"from": "gpt", "value": long_reply}]},
        {"conversations": [{"from": "human", "value": "hi"},  # too short: filtered
                           {"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "gpt", "value": "starts with the model"},
                           {"from": "human", "value": "so it is skipped entirely"}]},
        {"messages": [{"role": "user", "content": "explain the with statement please"},
                      {"role": "assistant", "content": long_reply}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(data))
    samples = build_dataset(DatasetSpec(name="sharegpt", path=str(path), num_prompts=10), tok)
    assert sorted(s.prompt for s in samples) == ["explain the with statement please",
                                                 "what is a file object in python?"]
    assert all(s.output_len == count(tok, long_reply) for s in samples)
    fixed = build_dataset(DatasetSpec(name="sharegpt", path=str(path), num_prompts=1,
                                      output_len=5), tok)
    assert len(fixed) == 1 and fixed[0].output_len == 5
    with pytest.raises(UsageError, match="dataset-path"):
        build_dataset(DatasetSpec(name="sharegpt"), tok)


def test_jsonl_prompts_cycle_in_file_order(tmp_path, tok):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"prompt number {i}"}) for i in range(3)))
    samples = build_dataset(DatasetSpec(name="jsonl", path=str(path), prompt_field="question",
                                        num_prompts=5), tok)
    assert [s.prompt for s in samples] == [f"prompt number {i}" for i in (0, 1, 2, 0, 1)]
    assert all(s.output_len == 128 and s.prompt_len == count(tok, s.prompt) for s in samples)
    with pytest.raises(ConfigError, match="no field 'prompt'"):
        build_dataset(DatasetSpec(name="jsonl", path=str(path)), tok)


def test_shared_prefix_workload(tok):
    spec = DatasetSpec(name="prefix", num_prefixes=3, questions_per_prefix=4, prefix_len=32,
                       input_len=8, output_len=4, seed=2)
    samples = build_dataset(spec, tok)
    assert len(samples) == 12
    per_prefix = Counter(s.system for s in samples)
    assert len(per_prefix) == 3 and set(per_prefix.values()) == {4}
    assert all(s.prompt_len == count(tok, join_prefix(s.system, s.prompt)) for s in samples)
    # Shuffled: not all questions of a prefix in one block.
    blocks = [samples[i].system == samples[i + 1].system for i in range(11)]
    assert not all(blocks)


def test_long_context(tok):
    samples = build_dataset(DatasetSpec(name="long-context", num_prompts=3, input_len=200,
                                        output_len=16), tok)
    for s in samples:
        assert s.prompt.endswith(LONG_CONTEXT_QUESTION)
        assert s.prompt_len == count(tok, s.prompt)
        assert abs(s.prompt_len - 200) <= 10  # windows re-tokenise at their edges
    assert len({s.prompt for s in samples}) == 3


def test_unknown_dataset_lists_known(tok):
    with pytest.raises(UsageError) as err:
        build_dataset(DatasetSpec(name="nope"), tok)
    assert "random" in err.value.remedy and "sharegpt" in err.value.remedy
