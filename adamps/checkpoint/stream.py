"""A restore's reading of a checkpoint's files (issue 38 item 7): checked whole first, then
streamed to the servers piece by piece, in buffers each thread reuses.

Why not read every file into memory once: a restore then holds the whole model, and on this
machine the first touch of fresh memory costs more than the read itself (0.68 s to fault in
256 MB, against 0.07 s for ``np.load`` of it into a warm heap): ``read_files`` and
``assemble`` took 3 s of a 0.25 GB restore. Here pass 1 reads each file in blocks of
``BLOCK`` bytes into a reused buffer, hashing each block and checking the bounds of every
array's part in it (min and max: a part's bound holds for the whole); pass 2 reads the byte
ranges of one request's shards into the sending thread's reused buffer and sends views of it.
A file that changed between the passes (size, modification time or inode) is refused.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adamps.checkpoint.format import CheckpointError, checked_name, safetensors_header

#: bytes hashed and checked at a time per file
BLOCK = 8 << 20
#: files checked at once (hashlib and numpy's min/max release the GIL)
CHECKERS = 4


@dataclass(frozen=True, slots=True)
class Piece:
    """One array of a checkpoint file: where its bytes are."""

    file: str
    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.nbytes // self.dtype.itemsize


class _Buffers(threading.local):
    def __init__(self) -> None:
        self.buf = np.empty(0, np.uint8)


def _signature(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ino


def _pread(fd: int, view: memoryview, offset: int, path: Path) -> None:
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k == 0:
            raise CheckpointError(f"{path}: shorter than when it was checked")
        got += k


class Stream:
    """The files of checkpoint `src` (its manifest's ``files``)."""

    def __init__(self, src: Path, manifest: dict[str, Any]) -> None:
        self.src = src
        self.entries: dict[str, Any] = manifest["files"]
        #: file -> array key -> its piece (from the header, pass 1)
        self.pieces: dict[str, dict[str, Piece]] = {}
        #: file -> (size, mtime, inode) when checked
        self.sigs: dict[str, tuple[int, int, int]] = {}
        self._local = _Buffers()

    # -- pass 1 --------------------------------------------------------------------------------

    def check(self, part: Callable[[str, str, np.ndarray], None]) -> None:
        """Every file: its size and sha256 those of the manifest, its header well formed, and
        `part(file, key, array)` called on every part of every array it holds (the whole
        array, or the part of it within one block)."""
        names = list(self.entries)
        with ThreadPoolExecutor(max(1, min(CHECKERS, len(names)))) as pool:
            for name, pieces, sig in pool.map(lambda n: self._check(n, part), names):
                self.pieces[name], self.sigs[name] = pieces, sig

    def _check(
        self, name: str, part: Callable[[str, str, np.ndarray], None]
    ) -> tuple[str, dict[str, Piece], tuple[int, int, int]]:
        want = self.entries[name]
        path = checked_name(self.src, name, want)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing") from None
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if st.st_size != want["bytes"]:
                raise CheckpointError(f"{path}: truncated or altered: {st.st_size} bytes, the "
                                      f"manifest says {want['bytes']}")  # fmt: skip
            h = hashlib.sha256()
            head, pieces, start = self._header(fd, path, st.st_size, name)
            h.update(head)
            buf = self._buffer(min(BLOCK, st.st_size - start))
            for b0 in range(start, st.st_size, BLOCK):
                n = min(BLOCK, st.st_size - b0)
                _pread(fd, memoryview(buf[:n]), b0, path)
                h.update(buf[:n])
                for key, p in pieces.items():
                    lo, hi = max(p.offset, b0), min(p.offset + p.nbytes, b0 + n)
                    if lo < hi:
                        part(name, key, buf[lo - b0 : hi - b0].view(p.dtype))
        finally:
            os.close(fd)
        if h.hexdigest() != want["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from the manifest)")
        return name, pieces, _signature(st)

    def _header(
        self, fd: int, path: Path, size: int, name: str
    ) -> tuple[bytes, dict[str, Piece], int]:
        """A safetensors file's header bytes, its arrays' pieces and where its data starts."""
        head, entries = safetensors_header(lambda at, n: os.pread(fd, n, at), size, path)
        for key, e in entries.items():
            if BLOCK % e.dtype.itemsize:  # a block's part of an array holds whole elements
                raise CheckpointError(f"{path}: entry {key!r}: {e.dtype} does not divide a "
                                      "block")  # fmt: skip
        pieces = {key: Piece(name, e.offset, e.nbytes, e.dtype, e.shape)
                  for key, e in entries.items()}  # fmt: skip
        return head, pieces, len(head)

    def piece(self, name: Any, key: str, what: str) -> Piece:
        """Array `key` of file `name` (checked), or a CheckpointError naming `what` lacks it."""
        got = self.pieces.get(name, {}).get(key) if isinstance(name, str) else None
        if got is None:
            raise CheckpointError(f"{self.src / 'manifest.json'}: {what}: {key!r} is in no "
                                  "listed file")  # fmt: skip
        return got

    # -- pass 2 --------------------------------------------------------------------------------

    def _buffer(self, n: int) -> np.ndarray:
        """This thread's buffer, at least n bytes (grown, never shrunk: its pages stay)."""
        if self._local.buf.size < n:
            self._local.buf = np.empty(max(n, 2 * self._local.buf.size), np.uint8)
        return self._local.buf

    def read(self, pieces: list[Piece]) -> list[np.ndarray]:
        """The arrays of `pieces`, read into this thread's buffer (valid until its next read)."""
        sizes = [-(-p.nbytes // 8) * 8 for p in pieces]  # each array 8-byte aligned
        buf = self._buffer(sum(sizes))
        fds: dict[str, int] = {}
        out = []
        at = 0
        try:
            for p, size in zip(pieces, sizes, strict=True):
                path = self.src / p.file
                if p.file not in fds:
                    fds[p.file] = fd = os.open(path, os.O_RDONLY)
                    if _signature(os.fstat(fd)) != self.sigs[p.file]:
                        raise CheckpointError(f"{path}: changed since it was checked; restore "
                                              "again from an unchanged checkpoint")  # fmt: skip
                _pread(fds[p.file], memoryview(buf[at : at + p.nbytes]), p.offset, path)
                out.append(buf[at : at + p.nbytes].view(p.dtype).reshape(p.shape))
                at += size
        except FileNotFoundError:
            raise CheckpointError(f"{self.src}: a file vanished during the restore") from None
        finally:
            for fd in fds.values():
                os.close(fd)
        return out
