"""File systems of their own for the servers' data directories, and the storage faults the chaos
tests inject into them (issue 29): a full disk (a filler file written until ENOSPC) and a stalled
disk (``fsfreeze``). Each server's directory is an ext4 file system in an image file,
loop-mounted (fsfreeze needs a real file system; a tmpfs cannot be frozen). Needs root."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: size of each server's file system: the nemesis' data (a few MB) and room to spare
IMAGE_MB = 96


def cannot_mount() -> str | None:
    """Why storage faults cannot be injected here, or None."""
    if os.geteuid() != 0:
        return "needs root to loop-mount a file system"
    for tool in ("mkfs.ext4", "fsfreeze", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"needs {tool} (util-linux, e2fsprogs)"
    with tempfile.TemporaryDirectory() as d:
        r = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", d], capture_output=True
        )
        if r.returncode != 0:
            return f"cannot mount: {r.stderr.decode(errors='replace').strip()}"
        subprocess.run(["umount", d], check=True)
    return None


def mount_image(img: Path, at: Path) -> None:
    with open(img, "wb") as f:
        f.truncate(IMAGE_MB << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(img)], check=True, capture_output=True)
    at.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-o", "loop", str(img), str(at)], check=True, capture_output=True)


@contextmanager
def server_disks(root: Path, server_ids: list[str]) -> Iterator[dict[str, Path]]:
    """Mounts a file system at root/<id> for each id; yields id -> mount point. On exit every
    mount is thawed and unmounted (lazily: a server killed late may still hold a file)."""
    mounts: dict[str, Path] = {}
    try:
        for sid in server_ids:
            at = root / sid
            mount_image(root / f"{sid}.img", at)
            mounts[sid] = at
        yield mounts
    finally:
        for at in mounts.values():
            thaw(at)
            subprocess.run(["umount", "-l", str(at)], capture_output=True, timeout=30)


def fill(at: Path) -> int:
    """Fills the file system at `at` with a filler file, written until ENOSPC; returns bytes."""
    n = 0
    chunk = b"\0" * (1 << 16)
    with open(at / "filler", "wb", buffering=0) as f:
        try:
            while True:
                n += f.write(chunk)
        except OSError as exc:
            if exc.errno != errno.ENOSPC:
                raise
    return n


def unfill(at: Path) -> None:
    (at / "filler").unlink(missing_ok=True)


def freeze(at: Path) -> None:
    subprocess.run(["fsfreeze", "--freeze", str(at)], check=True, timeout=30)


def thaw(at: Path) -> None:
    """Unfreezes `at` (nothing if it is not frozen)."""
    subprocess.run(["fsfreeze", "--unfreeze", str(at)], capture_output=True, timeout=30)


def durable(address: str) -> bool:
    """Whether the server at `address` says it can persist (/healthz 200); False when it says
    not (503) or does not answer."""
    try:
        with urllib.request.urlopen(f"http://{address}/healthz", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False
