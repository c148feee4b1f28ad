"""`adamps checkpoint save --to` as a user types it: a directory holding a checkpoint is refused
and left as it was (a mistyped path must not replace an older backup, nor a failed save destroy
it); a path that cannot be created is a message, never a traceback. No cluster is needed: both
are refused before any request (the controller address is a closed port)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


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
