"""docs/check.md lists every key of the pipeline file, as the typed config defines it."""

from pathlib import Path

from llmctl.check.pipeline import SECTIONS, keys_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "check.md"


def test_every_key_is_described_and_the_doc_is_current():
    for _, model in SECTIONS:
        for name, info in model.model_fields.items():
            assert info.description, f"{model.__name__}.{name} has no description"
    text = DOC.read_text()
    assert text.endswith(keys_markdown()), "docs/check.md is stale: regenerate its Keys section"
