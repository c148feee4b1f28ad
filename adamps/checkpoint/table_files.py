"""A table's rows as files for serving and loading: ``adamps export --table`` writes them,
``adamps table load`` reads them (issue 38).

Export reads a checkpoint (a running cluster's is saved first) one row shard (bucket) at a time:
each bucket's rows are sorted by id into a run on disk, then the runs are merged in id order
chunk by chunk (a k-way merge: each step writes every row up to the smallest of the runs' next
chunk ends), so memory holds one bucket and ``k * chunk`` rows, never the table. Formats:

- ``safetensors``: tensors ``ids`` (I64 [n], increasing) and ``rows`` (F32 [n, dim]), metadata
  ``{"table": NAME, "dim": DIM}``; written here as the format is specified (an 8-byte
  little-endian header length, the JSON header padded to 8 bytes, then the tensors' raw
  little-endian bytes), so it streams: ``safetensors.numpy.load_file`` reads it;
- ``npy``: ``OUT`` holds the rows (float32 [n, dim]) and ``OUT`` with ``.ids.npy`` for its
  ``.npy`` (``emb.npy`` -> ``emb.ids.npy``) the ids (int64 [n]): ``numpy.load`` reads both.

Load reads those, a dense 2-D ``.npy`` whose row index is the id (no ids file beside it), or a
checkpoint directory's table, memory-mapped, and yields (ids, rows) batches.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import safe_open

from adamps.checkpoint.format import (
    CheckpointError,
    checked_file,
    read_manifest,
    safetensors_header,
)
from adamps.optspec import Optimizer
from adamps.server.store.tables.rowblock import RowBlock
from adamps.tables import ROWS_SEP, Admission, TableError, TableSpec
from adamps.wire.protocol import MAX_GRAD

FORMATS = ("safetensors", "npy")
#: rows written per merge step and per run (the merge holds at most k runs x this)
CHUNK_ROWS = 65_536


class TableFileError(ValueError):
    """A table file that cannot be read or written; the message names the file."""


def ids_path(out: Path) -> Path:
    """The ids file beside an ``npy`` export's rows file."""
    stem = out.name[: -len(".npy")] if out.name.endswith(".npy") else out.name
    return out.with_name(stem + ".ids.npy")


# -- reading a checkpoint's table, bucket by bucket -----------------------------------------------


def _table_def(manifest: dict[str, Any], table: str, src: Path) -> dict[str, Any]:
    for t in manifest.get("tables", []):
        if t.get("name") == table:
            return t
    names = sorted(t.get("name", "?") for t in manifest.get("tables", []))
    raise TableFileError(f"{src}: no table {table!r} in this checkpoint (it has {names})")


def checkpoint_buckets(
    src: Path, table: str
) -> tuple[int, Iterator[tuple[np.ndarray, np.ndarray]]]:
    """(dim, each bucket's (ids, rows) of `table` in checkpoint `src`), one bucket in memory at
    a time; every file is checked against the manifest (size, sha256) before it is read."""
    try:
        manifest = read_manifest(src)
    except CheckpointError as exc:
        raise TableFileError(str(exc)) from None
    if manifest["format"] < 2:
        raise TableFileError(f"{src}: a format 1 checkpoint; export its table after a restore")
    d = _table_def(manifest, table, src)
    try:
        spec = TableSpec.from_dict(d)
    except TableError as exc:
        raise TableFileError(f"{src}: table {table!r}: {exc}") from None
    opt = Optimizer.from_dict(spec.optimizer)
    prefix = table + ROWS_SEP
    shards = sorted(
        (sid, rec) for sid, rec in manifest.get("row_shards", {}).items() if sid.startswith(prefix)
    )
    files = manifest["files"]

    def blocks() -> Iterator[tuple[np.ndarray, np.ndarray]]:
        checked: set[str] = set()
        for sid, rec in shards:
            name = rec.get("file")
            if name not in checked:
                try:
                    checked_file(src, name, files.get(name))
                except CheckpointError as exc:
                    raise TableFileError(str(exc)) from None
                checked.add(name)
            with safe_open(str(src / name), framework="numpy") as f:
                data = f.get_tensor(sid).tobytes()
            blk = RowBlock(spec.dim, spec.init, opt, Admission(), None, dtype=spec.dtype)
            try:
                blk.load_bytes(data)
            except (ValueError, struct.error) as exc:
                raise TableFileError(f"{src / name}: row shard {sid}: {exc}") from None
            del data
            assert blk.values is not None
            yield blk.ids[: blk.n], blk.values_f32(0, blk.n)

    return spec.dim, blocks()


# -- export ----------------------------------------------------------------------------------------


class _Out:
    """The output file(s), written at known offsets: n and dim are known before any row."""

    def __init__(self, out: Path, fmt: str, table: str, n: int, dim: int) -> None:
        self.files: list[tuple[Path, Path]] = []  # (temporary, final)
        if fmt == "npy":
            self.ids_fd, self.ids_at = self._open(ids_path(out), _npy_header("<i8", (n,)))
            self.rows_fd, self.rows_at = self._open(out, _npy_header("<f4", (n, dim)))
        else:
            header = _safetensors_header(table, n, dim)
            self.ids_fd, self.ids_at = self._open(out, header)
            self.rows_fd, self.rows_at = self.ids_fd, len(header) + 8 * n

    def _open(self, final: Path, header: bytes) -> tuple[int, int]:
        tmp = final.with_name(f".{final.name}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.write(fd, header)
        self.files.append((tmp, final))
        return fd, len(header)

    def write(self, ids: np.ndarray, rows: np.ndarray) -> None:
        for fd, a, at in ((self.ids_fd, ids, "ids_at"), (self.rows_fd, rows, "rows_at")):
            buf = np.ascontiguousarray(a).tobytes()
            off = getattr(self, at)
            view = memoryview(buf)
            while view:
                k = os.pwrite(fd, view, off)
                view, off = view[k:], off + k
            setattr(self, at, off)

    def finish(self) -> None:
        for fd in {self.ids_fd, self.rows_fd}:
            os.fsync(fd)
            os.close(fd)
        for tmp, final in self.files:
            os.replace(tmp, final)


def _npy_header(descr: str, shape: tuple[int, ...]) -> bytes:
    d = {"descr": descr, "fortran_order": False, "shape": shape}
    h = repr(d).encode("latin1")
    total = 10 + len(h) + 1
    h += b" " * (-total % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h


def _safetensors_header(table: str, n: int, dim: int) -> bytes:
    meta = {
        "__metadata__": {"table": table, "dim": str(dim)},
        "ids": {"dtype": "I64", "shape": [n], "data_offsets": [0, 8 * n]},
        "rows": {"dtype": "F32", "shape": [n, dim], "data_offsets": [8 * n, 8 * n + 4 * n * dim]},
    }
    h = json.dumps(meta, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    return struct.pack("<Q", len(h)) + h


def export_table(src: Path, table: str, out: Path, fmt: str, chunk: int = CHUNK_ROWS) -> int:
    """Table `table` of checkpoint `src` into `out` in id order, streamed; the rows written."""
    if fmt not in FORMATS:
        raise TableFileError(f"--format {fmt!r}: a table exports as one of {', '.join(FORMATS)}")
    dim, blocks = checkpoint_buckets(src, table)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = Path(tempfile.mkdtemp(prefix=f".{out.name}.runs-", dir=out.parent))
    try:
        lengths = []
        for k, (ids, rows) in enumerate(blocks):
            order = np.argsort(ids, kind="stable")
            np.save(runs / f"{k}.ids.npy", ids[order])
            np.save(runs / f"{k}.rows.npy", rows[order])
            lengths.append(len(ids))
            del ids, rows, order
        n = sum(lengths)
        w = _Out(out, fmt, table, n, dim)
        try:
            src_ids = [np.load(runs / f"{k}.ids.npy", mmap_mode="r") for k in range(len(lengths))]
            src_rows = [np.load(runs / f"{k}.rows.npy", mmap_mode="r") for k in range(len(lengths))]
            for ids, rows in _merge(src_ids, src_rows, chunk):
                w.write(ids, rows)
        except BaseException:
            for fd in {w.ids_fd, w.rows_fd}:
                os.close(fd)
            for tmp, _ in w.files:
                tmp.unlink(missing_ok=True)
            raise
        w.finish()
        return n
    finally:
        shutil.rmtree(runs, ignore_errors=True)


def _merge(
    ids: list[np.ndarray], rows: list[np.ndarray], chunk: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The sorted runs' (ids, rows) merged in id order (ids distinct across runs), in pieces of
    at most len(runs) * chunk rows: each piece is every row up to the smallest id that ends a
    run's next chunk, so no later row can sort before it."""
    pos = [0] * len(ids)
    while True:
        live = [k for k in range(len(ids)) if pos[k] < len(ids[k])]
        if not live:
            return
        bound = min(int(ids[k][min(pos[k] + chunk, len(ids[k])) - 1]) for k in live)
        got_ids, got_rows = [], []
        for k in live:
            window = np.asarray(ids[k][pos[k] : pos[k] + chunk])
            take = int(np.searchsorted(window, bound, side="right"))
            if take:
                got_ids.append(window[:take])
                got_rows.append(np.asarray(rows[k][pos[k] : pos[k] + take]))
                pos[k] += take
        a = np.concatenate(got_ids)
        order = np.argsort(a, kind="stable")
        yield a[order], np.concatenate(got_rows)[order]


# -- load ------------------------------------------------------------------------------------------


def _checked(path: Path, what: str, a: np.ndarray, ndim: int) -> None:
    if a.ndim != ndim:
        raise TableFileError(f"{path}: {what} must be {ndim}-D, got shape {list(a.shape)}")


def read_rows(src: Path, table: str | None = None) -> tuple[int, int, Any]:
    """(rows, dim, batches(size) -> iterator of (ids int64, rows float32)) of a load source:
    an ``.npy`` (with its ``.ids.npy`` beside it, or a dense 2-D array whose row index is the
    id), an export's ``.safetensors``, or a checkpoint directory's `table`."""
    if src.is_dir():
        if table is None:
            raise TableFileError(
                f"{src}: a checkpoint directory; name its table with --source-table"
            )
        dim, blocks = checkpoint_buckets(src, table)
        return -1, dim, lambda size: _rebatch(blocks, size)
    if not src.is_file():
        raise TableFileError(f"{src}: no such file (expected .npy, .safetensors or a checkpoint)")
    if src.suffix == ".npy":
        try:
            rows = np.load(src, mmap_mode="r")
        except (ValueError, OSError, EOFError) as exc:  # EOFError: an empty file
            raise TableFileError(f"{src}: not a .npy array of rows: {exc}") from None
        _checked(src, "the rows", rows, 2)
        if rows.dtype.kind != "f":  # ints, bools, complex or strings were cast (or a traceback)
            raise TableFileError(
                f"{src}: expected rows of floats (float32, float16 or float64), got {rows.dtype}"
            )
        idp = ids_path(src)
        ids = None
        if idp.is_file():
            try:
                ids = np.load(idp, mmap_mode="r")
            except (ValueError, OSError, EOFError) as exc:
                raise TableFileError(f"{idp}: not a .npy array of ids: {exc}") from None
            _checked(idp, "the ids", ids, 1)
            if len(ids) != len(rows) or ids.dtype.kind not in "iu":
                raise TableFileError(
                    f"{idp}: expected {len(rows)} integer ids (one per row of {src.name}), "
                    f"got {ids.dtype} {list(ids.shape)}"
                )
        _check_values(src, ids, rows)
        return len(rows), rows.shape[1], lambda size: _slices(ids, rows, size)
    if src.suffix == ".safetensors":
        ids, rows = _safetensors_views(src)
        _checked(src, "'rows'", rows, 2)
        _checked(src, "'ids'", ids, 1)
        if len(ids) != len(rows):
            raise TableFileError(f"{src}: {len(ids)} ids for {len(rows)} rows")
        _check_values(src, ids, rows)
        return len(rows), rows.shape[1], lambda size: _slices(ids, rows, size)
    raise TableFileError(
        f"{src}: expected a .npy or .safetensors file or a checkpoint directory, "
        f"got {src.suffix or 'no suffix'}"
    )


_DTYPES = {"I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "F32": np.dtype("<f4")}


def _check_values(src: Path, ids: np.ndarray | None, rows: np.ndarray) -> None:
    """A pass over a file's rows before anything is sent (docs/operations.md, "Loading a
    table"): every value finite and within the servers' bound on pushed values, no id twice.
    Otherwise the table was created and the batches before the bad one loaded, then the
    client's own check refused the batch as "cluster error: ... grads" (or, for an id twice,
    a traceback-free exit code 2 that named no file)."""
    for lo in range(0, len(rows), CHUNK_ROWS):
        with np.errstate(over="ignore"):  # a float64 beyond float32 is an Inf, refused below
            chunk = np.asarray(rows[lo : lo + CHUNK_ROWS], np.float32)
        if not chunk.size:
            continue
        ok = np.isfinite(chunk)
        if not ok.all():
            r = lo + int(np.argwhere(~ok)[0][0])
            raise TableFileError(
                f"{src}: row {r} holds a NaN or Inf value (as float32): expected finite values"
            )
        m = float(np.abs(chunk).max())
        if m > MAX_GRAD:
            raise TableFileError(
                f"{src}: a value of magnitude {m:.3g} in rows [{lo}, {lo + len(chunk)}): "
                f"expected at most {MAX_GRAD:.0e} (docs/protocol-ps.md, 'Finite values')"
            )
    if ids is None or len(ids) < 2:
        return
    increasing = all(
        bool(np.all(np.diff(np.asarray(ids[lo : lo + CHUNK_ROWS + 1])) > 0))
        for lo in range(0, len(ids) - 1, CHUNK_ROWS)
    )
    if not increasing:  # an export's ids increase; others are sorted once to find a repeat
        srt = np.sort(np.asarray(ids))
        twice = np.flatnonzero(srt[1:] == srt[:-1])
        if len(twice):
            raise TableFileError(f"{src}: id {int(srt[twice[0]])} appears more than once")


def _safetensors_views(src: Path) -> tuple[np.ndarray, np.ndarray]:
    """The ``ids`` and ``rows`` tensors of a safetensors file, memory-mapped (its header read
    by the checkpoints' one parser of the format, ``format.safetensors_header``)."""
    size = src.stat().st_size

    with src.open("rb") as f:

        def read(at: int, n: int) -> bytes:
            f.seek(at)
            return f.read(n)

        try:
            _head, entries = safetensors_header(read, size, src, _DTYPES)
        except CheckpointError as exc:
            raise TableFileError(f"{exc} (ids I64/I32 and rows F32 expected)") from None
    if not {"ids", "rows"} <= set(entries):
        raise TableFileError(
            f"{src}: expected tensors 'ids' and 'rows' (adamps export --table), "
            f"got {sorted(entries)}"
        )
    out = []
    for name in ("ids", "rows"):
        e = entries[name]
        out.append(np.memmap(src, e.dtype, "r", e.offset, e.shape) if e.nbytes else
                   np.empty(e.shape, e.dtype))  # fmt: skip
    ids, rows = out
    if ids.dtype.kind != "i" or rows.dtype != np.float32:
        raise TableFileError(f"{src}: expected integer 'ids' and float32 'rows'")
    return ids, rows


def _slices(
    ids: np.ndarray | None, rows: np.ndarray, size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for lo in range(0, len(rows), size):
        hi = min(lo + size, len(rows))
        i = np.arange(lo, hi, dtype=np.int64) if ids is None else np.asarray(ids[lo:hi])
        yield i.astype(np.int64), np.ascontiguousarray(rows[lo:hi], np.float32)


def _rebatch(
    blocks: Iterator[tuple[np.ndarray, np.ndarray]], size: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for ids, rows in blocks:
        for lo in range(0, len(ids), size):
            yield ids[lo : lo + size].copy(), np.ascontiguousarray(rows[lo : lo + size])
