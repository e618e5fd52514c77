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


def test_every_example_pipeline_validates(tmp_path, monkeypatch):
    """What examples/ ship is a pipeline `llmctl check` accepts (recipes, build options
    and gates included); running them is tests/check/test_smollm2.py's and the tiny
    model's job."""
    from llmctl.check.judge import precheck
    from llmctl.check.pipeline import load_pipeline
    from llmctl.check.runner import CheckRunner

    monkeypatch.setenv("LLMCTL_HOME", str(tmp_path))
    examples = sorted((DOC.parents[1] / "examples").glob("check-*.yaml"))
    assert len(examples) >= 2
    for path in examples:
        pipeline = load_pipeline(path)
        precheck(pipeline, None)
        CheckRunner(pipeline, tmp_path / "out").validate()
