"""``llmctl serve --lora``: bad adapters are usage errors (exit 2, one error line naming
the option and a hint) before any model loads."""

import pytest

from tests.cli.test_usage_errors import assert_usage_error, run


@pytest.mark.parametrize("value, expected", [
    ("nameonly", "is not NAME=PATH"),
    ("=/some/dir", "is not NAME=PATH"),
    ("x=/no/such/adapter", "is not a directory"),
])
def test_malformed_or_missing_lora(value, expected):
    assert_usage_error(run("serve", "m", "--lora", value), "--lora", expected)


def test_rank_above_max_lora_rank(tiny_loras):
    result = run("serve", "m", "--lora", f"a={tiny_loras['some8']}", "--max-lora-rank", "4")
    assert_usage_error(result, "--lora a", "rank 8, above --max-lora-rank 4")


def test_duplicate_names_and_hand_off(tiny_loras):
    path = tiny_loras["all4"]
    assert_usage_error(run("serve", "m", "--lora", f"a={path}", "--lora", f"a={path}"),
                       "--lora a", "given twice")
    assert_usage_error(run("serve", "m", "--engine", "vllm", "--lora", f"a={path}"),
                       "--lora", "vllm")
