"""`adamps checkpoint save --to` as a user types it: a directory holding a checkpoint is refused
and left as it was (a mistyped path must not replace an older backup, nor a failed save destroy
it); a path that cannot be created is a message, never a traceback. No cluster is needed: both
are refused before any request (the controller address is a closed port)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest


def save(to: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adamps", "checkpoint", "save", "--to", str(to),
         "--controllers", "http://127.0.0.1:1", "--token", "wrong"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def test_a_directory_holding_a_checkpoint_is_refused_and_kept(tmp_path: Path) -> None:
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    (ckpt / "manifest.json").write_text('{"format": 2}')
    (ckpt / "b0.safetensors").write_bytes(b"x" * 10)
    out = save(ckpt)
    assert out.returncode == 1, out
    assert "holds a checkpoint" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert (ckpt / "manifest.json").read_text() == '{"format": 2}'
    assert (ckpt / "b0.safetensors").read_bytes() == b"x" * 10


def test_a_path_that_cannot_be_made_is_a_message(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    for to in (tmp_path / "file" / "sub", tmp_path / "file"):
        out = save(to)
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert str(to) in out.stderr, out.stderr


def restore(src: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adamps", "checkpoint", "restore", "--from", str(src),
         "--controllers", "http://127.0.0.1:1", "--token", "wrong"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


def _one_line_error(out: subprocess.CompletedProcess, *words: str) -> None:
    """Exit code 1, one line on stderr naming the problem, no traceback, nothing on stdout."""
    assert out.returncode == 1, out
    assert "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("adamps checkpoint restore: "), out.stderr
    for w in words:
        assert w in lines[0], out.stderr
    assert out.stdout == "", out.stdout


def _manifest(d: Path, fields: dict) -> Path:
    d.mkdir()
    (d / "bucket-0000.safetensors").write_bytes(b"\0" * 64)
    files = {"bucket-0000.safetensors": {"bytes": 64, "sha256": "0" * 64}}
    (d / "manifest.json").write_text(json.dumps({"format": 2, "files": files, **fields}))
    return d


def test_a_manifest_claiming_1e12_elements_is_a_message(tmp_path: Path) -> None:
    """Issue 39 #12: refused from the manifest alone (the files hold 64 bytes), before any
    allocation of the claimed 4 TB."""
    d = _manifest(tmp_path / "c", {"n_buckets": 1, "tensors": [
        {"name": "w", "shape": [1000000, 1000000], "optimizer": {"kind": "sgd"}}]})  # fmt: skip
    _one_line_error(restore(d), "1000000000000 elements", "manifest.json")


def test_deeply_nested_json_is_a_message(tmp_path: Path) -> None:
    d = tmp_path / "c"
    d.mkdir()
    (d / "manifest.json").write_text(
        '{"format": 2, "files": ' + "[" * 200_000 + "]" * 200_000 + "}"
    )
    _one_line_error(restore(d), "nested too deeply", "manifest.json")


def test_an_oversized_manifest_is_refused_unread(tmp_path: Path) -> None:
    from adamps.checkpoint import schema as ckpt_schema

    d = tmp_path / "c"
    d.mkdir()
    with (d / "manifest.json").open("wb") as f:  # sparse: no disk used
        f.truncate(ckpt_schema.MAX_MANIFEST_BYTES + 1)
    _one_line_error(restore(d), "more than a manifest may have")


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tensors": [{"name": "w", "shape": ["4"]}]}, "shape[0]"),
        ({"tensors": [{"name": "w", "shape": [-4]}]}, "shape[0]"),
        ({"tensors": {"w": [4]}}, "'tensors'"),
        ({"tensors": [{"name": "w", "shape": []}]}, "1..8 dimensions"),
        ({"tensors": [{"name": "w", "shape": [4], "optimizer": "sgd"}]}, "optimizer"),
        ({"n_buckets": "4"}, "'n_buckets'"),
        ({"tables": [{"name": "e"}]}, "dim"),
        (
            {
                "shards": {
                    "w/0": {
                        "tensor": "w",
                        "file": "bucket-0000.safetensors",
                        "start": "0",
                        "stop": 4,
                    }
                }
            },
            "start",
        ),  # fmt: skip
        ({"row_shards": {"e#rows/x": {"file": "bucket-0000.safetensors"}}}, "/<bucket>"),
        # a version past 2^62 would overflow a shard's record once a push adds one (skeptic 17)
        (
            {"row_shards": {"e#rows/0": {"file": "bucket-0000.safetensors", "version": 2**64}}},
            "version must be an int in [0, 4611686018427387904]",
        ),
    ],
)
def test_a_field_of_the_wrong_kind_is_named(tmp_path: Path, fields: dict, named: str) -> None:
    _one_line_error(restore(_manifest(tmp_path / "c", fields)), named)


def test_a_non_empty_directory_that_is_no_checkpoint_is_refused_and_kept(tmp_path: Path) -> None:
    """Issue 39 #13: a mistyped --to pointing at someone's data is refused before any request,
    naming what the directory holds; nothing is written into it."""
    d = tmp_path / "home"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    out = save(d)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "not empty and not a checkpoint" in out.stderr and "notes.txt" in out.stderr, out.stderr
    assert sorted(p.name for p in d.iterdir()) == ["notes.txt"]


def test_a_failed_saves_directory_is_taken_again(tmp_path: Path) -> None:
    """What a save that died leaves (data files, no manifest) is no one else's data: --to may
    name it (the save then fails here only at the closed controller port)."""
    d = tmp_path / "ck"
    d.mkdir()
    (d / "bucket-0003.safetensors").write_bytes(b"x")
    (d / ".bucket-0004.safetensors.tmp").write_bytes(b"x")
    out = save(d)
    assert out.returncode == 1 and "not a checkpoint" not in out.stderr, out.stderr
    assert "cluster error" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("arrays", "named"),
    [
        ({"w": np.array([1.0, np.nan, 2.0], np.float32)}, "tensor 'w'"),
        ({"w": np.array([1.0, 3e38, 2.0], np.float32)}, "tensor 'w'"),
        ({"w": np.zeros(3, np.float32), "w/accum": np.array([0, -1, 0], np.float32)}, "negative"),
    ],
)
def test_a_checkpoint_holding_non_finite_values_is_refused_before_any_write(
    tmp_path: Path, arrays: dict, named: str
) -> None:
    """Issue 39 #7: a checkpoint whose data is NaN, huge or a negative accumulator (its
    checksums consistent) is refused from the files alone, naming the tensor: no server is
    asked anything (the controller address is a closed port)."""
    from adamps.checkpoint.save_restore import write

    d = tmp_path / "c"
    write(d, arrays, {}, {"n_buckets": 4, "tables": [],
                          "tensors": [{"name": "w", "shape": [3]}]})  # fmt: skip
    _one_line_error(restore(d), named, "nothing restored")
