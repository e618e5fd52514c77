import json

import pytest

from llmctl.data.sources import fixed_windows, load_text_source, sample_windows
from llmctl.errors import ConfigError, ModelNotFoundError, OfflineError


def test_builtin_pydoc_splits_are_disjoint_and_stable():
    calib = load_text_source("builtin:pydoc-calib")
    held = load_text_source("builtin:pydoc-heldout")
    assert len(calib.texts) > 3 * len(held.texts) > 0
    assert not set(calib.texts) & set(held.texts)
    assert calib.sha256 == load_text_source("builtin:pydoc-calib").sha256


def test_local_files(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    assert load_text_source(str(tmp_path / "a.txt")).texts == ["hello world"]
    rows = [{"text": "one"}, {"text": "two", "x": 1}]
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    assert load_text_source(str(tmp_path / "b.jsonl")).texts == ["one", "two"]
    (tmp_path / "c.jsonl").write_text(json.dumps({"body": "x"}))
    with pytest.raises(ConfigError, match="no field 'text'"):
        load_text_source(str(tmp_path / "c.jsonl"))
    assert load_text_source(str(tmp_path / "c.jsonl"), field="body").texts == ["x"]


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["p1", "p2"]}), tmp_path / "d.parquet")
    assert load_text_source(str(tmp_path / "d.parquet")).texts == ["p1", "p2"]


def test_bad_sources(tmp_path, monkeypatch):
    with pytest.raises(ModelNotFoundError):
        load_text_source(str(tmp_path / "missing.txt"))
    with pytest.raises(ConfigError, match="unknown built-in"):
        load_text_source("builtin:nope")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    # huggingface_hub and datasets read HF_HUB_OFFLINE once, at import: in the full suite
    # an earlier test has imported them, the variable above comes too late and the load
    # went to the network (23 s of connection retries, and a pass only while it fails).
    # Offline in this process too, whatever was imported before.
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    with pytest.raises(OfflineError):
        load_text_source("hf:nosuch/dataset")


def test_windows():
    ids = list(range(100))
    assert fixed_windows(ids, seq_len=30) == [ids[0:30], ids[30:60], ids[60:90]]
    assert len(fixed_windows(ids, seq_len=30, stride=10)) == 8
    a = sample_windows(ids, seq_len=10, num=5, seed=3)
    assert a == sample_windows(ids, seq_len=10, num=5, seed=3)
    assert all(len(w) == 10 and w == ids[w[0]:w[0] + 10] for w in a)
    with pytest.raises(ConfigError):
        sample_windows(ids, seq_len=200, num=1, seed=0)
