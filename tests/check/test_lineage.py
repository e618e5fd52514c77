"""Artifact IDs: named by what made them, not by where the inputs lay."""

from llmctl.check.lineage import FileHashes, artifact_id, identity


def _lineage(recipe_path: str, text: str, model_sha: str = "m" * 64) -> dict:
    return {"kind": "quantize", "model": {"reference": "/a/model", "sha256": model_sha},
            "recipe": {"reference": recipe_path, "text": text},
            "calibration": {"source": "builtin:pydoc-calib", "ids_sha256": "c" * 64}}


def test_same_inputs_elsewhere_same_id_any_change_another():
    base = artifact_id(_lineage("/ci/one/w4.yaml", "scheme: W4A16"))
    assert base == artifact_id(_lineage("/home/two/w4.yaml", "scheme: W4A16"))
    assert base != artifact_id(_lineage("/ci/one/w4.yaml", "scheme: W8A16"))
    assert base != artifact_id(_lineage("/ci/one/w4.yaml", "scheme: W4A16", "n" * 64))
    assert len(base) == 16
    assert "reference" not in identity(_lineage("x", "y"))["recipe"]


def test_file_hashes_are_remembered_by_stat_and_redone_on_change(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "w.safetensors").write_bytes(b"\0" * 1000)
    hashes = FileHashes(tmp_path / "hashes.json")
    first = hashes.directory(model)
    hashes.save()
    again = FileHashes(tmp_path / "hashes.json")
    assert again.directory(model) == first and not again._dirty  # from the stored table
    (model / "w.safetensors").write_bytes(b"\1" * 1001)  # (size, mtime) tell it changed
    assert again.directory(model) != first
