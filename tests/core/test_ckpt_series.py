"""Periodic checkpoints' pure parts (issue 24): the replicated record and its schedule, and the
pruning of a series of incremental checkpoints (files on disk, no cluster)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from adamps.checkpoint import series as ckpt_series
from adamps.checkpoint.format import load, write_file, write_manifest
from controller import ckpt_record
from controller.state import ClusterModel


def _done(name: str, started: float = 0.0) -> dict:
    return {"name": name, "bytes": 10, "written_bytes": 5, "seconds": 0.5,
            "consistent": False, "started": started}  # fmt: skip


def test_the_schedule_is_due_from_the_replicated_record() -> None:
    rec = ckpt_record.empty()
    assert not ckpt_record.due(rec, 0.0, 100.0)  # off
    assert ckpt_record.due(rec, 10.0, 100.0)  # never taken: due at once
    assert ckpt_record.apply(rec, "begin", {"name": "a", "term": 2}, 100.0)["ok"]
    assert ckpt_record.due(rec, 10.0, 100.5)  # begun is not done: a new leader takes over
    assert ckpt_record.apply(rec, "done", _done("a", 100.0), 101.0) == {"ok": True, "count": 1}
    assert rec["begun"] is None and rec["last"]["finished"] == 101.0
    assert not ckpt_record.due(rec, 10.0, 110.9)
    assert ckpt_record.due(rec, 10.0, 111.0)


def test_a_malformed_entry_is_refused_and_changes_nothing() -> None:
    rec = ckpt_record.empty()
    for action, fields in (("done", {"name": "a"}), ("begin", {}), ("nope", {}), ("done", [])):
        assert ckpt_record.apply(rec, action, fields, 1.0)["ok"] is False
    assert rec == ckpt_record.empty()


def test_the_model_keeps_the_record_also_from_a_dump_without_one() -> None:
    from adamps.core.lease import LeaseTerms

    m = ClusterModel(4, LeaseTerms(5.0, 0.1, 0.5))
    m.__dict__.pop("checkpoints", None)  # as unpickled from a dump of the previous release
    assert m.x_checkpoint("done", _done("a"), 5.0)["ok"]
    assert m.checkpoint_record()["count"] == 1 and m.clock == 5.0


def _series_ckpt(root: Path, number: int, base: Path | None, changed: dict[str, float]) -> Path:
    """A format-2 checkpoint of tensor 'w' (2 shards, one per bucket) that writes the shards
    in `changed` and names `base`'s file for the others."""
    d = root / ckpt_series.name_of(number, 1)
    d.mkdir(parents=True)
    prev = json.loads((base / "manifest.json").read_text()) if base else None
    shards, files = {}, {}
    for b, sid in enumerate(("w/0", "w/1")):
        rec = {"tensor": "w", "start": 2 * b, "stop": 2 * b + 2, "bucket": b, "epoch": 1}
        if sid in changed:
            fname = f"bucket-{b:04d}.safetensors"
            files[fname] = write_file(d / fname, {sid: np.full(2, changed[sid], np.float32)})
            shards[sid] = {**rec, "file": fname, "version": number}
        else:
            old = prev["shards"][sid]
            rel = old["file"] if old["file"].startswith("../") else f"../{base.name}/{old['file']}"
            shards[sid] = {**old, "file": rel}
            files[rel] = prev["files"][old["file"]]
    write_manifest(d, {"n_buckets": 2, "tensors": [{"name": "w", "shape": [4]}], "tables": [],
                       "cuts": {}, "shards": shards, "row_shards": {}, "files": files,
                       "seconds": 0.1})  # fmt: skip
    return d


def test_prune_never_deletes_a_file_a_kept_checkpoint_names(tmp_path: Path) -> None:
    c1 = _series_ckpt(tmp_path, 1, None, {"w/0": 1.0, "w/1": 1.0})
    c2 = _series_ckpt(tmp_path, 2, c1, {"w/0": 2.0})  # w/1 still in c1's file
    c3 = _series_ckpt(tmp_path, 3, c2, {"w/0": 3.0})  # w/1 in c1's file, not a chain via c2
    half = tmp_path / ckpt_series.name_of(4, 1)  # a save that died midway
    half.mkdir()
    (half / "bucket-0000.safetensors").write_bytes(b"partial")
    assert load(c3)[1]["w"].tolist() == [3.0, 3.0, 1.0, 1.0]
    assert ckpt_series.newest(tmp_path) == c3
    dropped = ckpt_series.prune(tmp_path, keep=1)
    assert dropped == [c1, c2]
    assert not c2.exists()  # nothing of it is named by c3
    assert not (c1 / "manifest.json").exists() and (c1 / "bucket-0001.safetensors").exists()
    assert not (c1 / "bucket-0000.safetensors").exists()
    assert half.exists()  # newer than the newest complete one: may be a save under way
    assert ckpt_series.complete(tmp_path) == [c3]
    assert load(c3)[1]["w"].tolist() == [3.0, 3.0, 1.0, 1.0]


def test_a_damaged_file_of_the_base_is_named_by_the_incremental_checkpoint(tmp_path: Path) -> None:
    import pytest

    from adamps.checkpoint.format import CheckpointError

    c1 = _series_ckpt(tmp_path, 1, None, {"w/0": 1.0, "w/1": 1.0})
    c2 = _series_ckpt(tmp_path, 2, c1, {"w/0": 2.0})
    f = c1 / "bucket-0001.safetensors"  # w/1, which c2 names
    f.write_bytes(f.read_bytes()[:-3])
    with pytest.raises(CheckpointError, match=r"ckpt-000001-t1/bucket-0001\.safetensors: trunc"):
        load(c2)
    other = _series_ckpt(tmp_path / "other", 1, None, {"w/0": 1.0, "w/1": 1.0})
    m = json.loads((other / "manifest.json").read_text())
    m["files"] = {"../../x/bucket-0001.safetensors": {"bytes": 1, "sha256": "0"}}
    (other / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"is not a checkpoint file"):
        load(other)


def test_the_docs_read_a_checkpoint_without_adamps(tmp_path: Path, monkeypatch) -> None:
    """docs/operations.md's snippet (json, hashlib, safetensors, numpy only) reads a format-2
    incremental checkpoint, files of its base included."""
    import re

    c1 = _series_ckpt(tmp_path, 1, None, {"w/0": 1.0, "w/1": 1.0})
    c2 = _series_ckpt(tmp_path, 2, c1, {"w/0": 2.0})
    text = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    block = re.findall(r"```python\n(.*?)```", text[text.index("**The format** (version 2") :],
                       re.S)[0]  # fmt: skip
    assert "import adamps" not in block and "from adamps" not in block
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(block.replace('d = "run1-0001"', f'd = "{c2.name}"'), ns)  # noqa: S102
    assert ns["w"]["w"].tolist() == [2.0, 2.0, 1.0, 1.0]
