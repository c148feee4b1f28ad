"""The checkpoint format's checks (issue 24): every damaged or foreign checkpoint is refused
with an error naming the file and the problem, before anything is written anywhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from adamps.checkpoint.save_restore import FORMAT, CheckpointError, load, write


def _ckpt(d: Path) -> Path:
    arrays = {"w": np.arange(12, dtype=np.float32).reshape(3, 4),
              "w/accum": np.ones((3, 4), np.float32)}  # fmt: skip
    rows = {"emb#rows/0": np.frombuffer(b"\x01\x02\x03\x04", np.uint8)}
    write(d, arrays, rows, {"n_buckets": 4, "tensors": [{"name": "w", "shape": [3, 4]}],
                            "tables": [], "consistent": False, "cuts": {}})  # fmt: skip
    return d


def test_a_checkpoint_reads_back_with_plain_safetensors_and_json(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    m = json.loads((d / "manifest.json").read_text())
    assert m["format"] == 1 and set(m["files"]) == {"tensors.safetensors", "rows.safetensors"}
    t = load_file(str(d / "tensors.safetensors"))
    assert t["w"].tobytes() == np.arange(12, dtype=np.float32).tobytes()
    manifest, arrays, rows = load(d)
    assert arrays["w/accum"].sum() == 12 and rows["emb#rows/0"].tobytes() == b"\x01\x02\x03\x04"


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    p = d / "tensors.safetensors"
    p.write_bytes(p.read_bytes()[:-7])
    with pytest.raises(CheckpointError, match=r"tensors\.safetensors: truncated"):
        load(d)


def test_a_checksum_mismatch_is_named(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    p = d / "rows.safetensors"
    data = bytearray(p.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    p.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rows\.safetensors: checksum mismatch"):
        load(d)


def test_a_newer_format_version_is_refused(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    m = json.loads((d / "manifest.json").read_text())
    m["format"] = FORMAT + 1
    (d / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match=r"manifest\.json: format version 3 is newer"):
        load(d)


@pytest.mark.parametrize("text", ["{not json", '{"format": "1"}', "[]"])
def test_a_damaged_manifest_is_named(tmp_path: Path, text: str) -> None:
    d = _ckpt(tmp_path / "c")
    (d / "manifest.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"manifest\.json"):
        load(d)


def test_a_directory_without_a_manifest_is_no_checkpoint(tmp_path: Path) -> None:
    d = _ckpt(tmp_path / "c")
    (d / "manifest.json").unlink()  # what a save that failed midway leaves
    with pytest.raises(CheckpointError, match="no manifest"):
        load(d)


def test_a_tensor_missing_from_the_file_is_named(tmp_path: Path) -> None:
    d = tmp_path / "c"
    write(d, {"w": np.zeros(3, np.float32)}, {},
          {"tensors": [{"name": "v", "shape": [3]}], "tables": []})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"tensor 'v' missing"):
        load(d)
