import pytest

from llmctl.utils.atomic import atomic_dir, atomic_file


def test_atomic_dir_appears_only_on_success(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("crash mid-way")
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(target) as tmp:
        (tmp / "whole.bin").write_bytes(b"x")
    assert (target / "whole.bin").read_bytes() == b"x"


def test_atomic_dir_refuses_or_replaces_existing(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old").write_text("old")
    with pytest.raises(FileExistsError):
        with atomic_dir(target):
            pass
    assert (target / "old").exists()
    with atomic_dir(target, overwrite=True) as tmp:
        (tmp / "new").write_text("new")
    assert sorted(p.name for p in target.iterdir()) == ["new"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_file_keeps_old_content_on_failure(tmp_path):
    target = tmp_path / "report.json"
    target.write_text("old")
    with pytest.raises(ValueError):
        with atomic_file(target, "w") as handle:
            handle.write("new")
            raise ValueError
    assert target.read_text() == "old"
    with atomic_file(target, "w") as handle:
        handle.write("new")
    assert target.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]
