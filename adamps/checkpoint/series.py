"""A series of periodic checkpoints in one directory (issue 24): the controllers' leader takes
one every ``checkpoint_interval`` seconds (controller/ckpt_schedule.py), each incremental on the
newest complete one, and keeps the newest ``keep``.

Names are ``ckpt-<number>-t<term>``: the number is the replicated count of completed
checkpoints plus one, the term that of the leader that took it, so two leaders of different
terms never write into the same directory, and the names sort in the order taken. A checkpoint
of an incremental series is complete only together with the checkpoints whose files it names;
``prune`` never deletes a file that a kept checkpoint names.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

from adamps.checkpoint.format import MANIFEST, read_manifest, referenced

_NAME_RE = re.compile(r"ckpt-([0-9]{6})-t([0-9]+)")  # fullmatch: "$" lets a final "\n" in


def name_of(number: int, term: int) -> str:
    return f"ckpt-{number:06d}-t{term}"


def order(p: Path) -> tuple[int, int]:
    """(number, term) of a series directory: the order they were taken in."""
    m = _NAME_RE.fullmatch(p.name)
    return (int(m[1]), int(m[2])) if m else (-1, -1)


def taken(root: Path) -> list[Path]:
    """The series' directories (complete or not), oldest first."""
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if _NAME_RE.fullmatch(p.name)), key=order)


def complete(root: Path) -> list[Path]:
    """The series' checkpoints that have a readable manifest, oldest first."""
    out = []
    for p in taken(root):
        try:
            read_manifest(p)
        except Exception:  # a save that failed midway (no manifest) or a damaged one
            continue
        out.append(p)
    return out


def newest(root: Path) -> Path | None:
    done = complete(root)
    return done[-1] if done else None


def prune(root: Path, keep: int) -> list[Path]:
    """Keeps the newest `keep` complete checkpoints: every older directory (and every
    incomplete one older than the newest complete one) loses its manifest and every file no
    kept checkpoint names; a directory left empty is removed. Returns the removed checkpoints."""
    done = complete(root)
    if keep <= 0 or not done:
        return []
    kept = done[-keep:]
    needed: set[Path] = set()
    for p in kept:
        needed |= referenced(p)
    newest_done = done[-1]
    dropped = []
    for p in taken(root):
        if p in kept or order(p) > order(newest_done):  # a newer directory may be a save under way
            continue
        # The manifest first: once it is gone the directory is no checkpoint, whatever the
        # deletion of its files below leaves of it after a crash.
        (p / MANIFEST).unlink(missing_ok=True)
        for f in p.iterdir():
            if f.resolve() not in needed:
                if f.is_dir():
                    shutil.rmtree(f, ignore_errors=True)
                else:
                    f.unlink(missing_ok=True)
        if not any(p.iterdir()):
            p.rmdir()
        dropped.append(p)
    return dropped


def summary(manifest: dict[str, Any], name: str) -> dict[str, Any]:
    """What the controllers record of a completed checkpoint (small, plain: a Raft argument)."""
    return {
        "name": name,
        "bytes": int(sum(f["bytes"] for f in manifest["files"].values())),
        "written_bytes": int(manifest.get("written_bytes", 0)),
        "seconds": float(manifest["seconds"]),
        "consistent": bool(manifest.get("consistent", False)),
        "hold_ms": float(manifest.get("hold_ms", 0.0)),
    }
