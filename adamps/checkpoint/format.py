"""The checkpoint format on disk (issue 24): how a checkpoint directory is written and checked.

Version 2 (what ``adamps checkpoint save`` and the periodic checkpoints write):

- ``manifest.json``: ``format``, ``n_buckets``, ``max_shard_elems``, the tensors' and tables'
  definitions, ``cuts`` (per bucket the ``{epoch, seq}`` it was read at), ``consistent``,
  ``shards`` (per dense shard id: its ``tensor``, ``start``, ``stop`` in the flattened tensor,
  ``file``, and the ``epoch`` and ``version`` it was read at), ``row_shards`` (per row shard id:
  ``file``, ``epoch``, ``version``), and ``files`` (per file: ``bytes`` and ``sha256``);
- ``bucket-NNNN.safetensors``: the shards of bucket NNNN that changed since the checkpoint this
  one is based on (all of them in a full checkpoint): ``<shard id>`` float32 values (flat),
  ``<shard id>/accum`` its Adagrad accumulator, ``<row shard id>`` the uint8 bytes of a row
  block (rowblock.py).

An incremental checkpoint names, for an unchanged shard, the file of an earlier checkpoint in the
same parent directory (``../<name>/bucket-NNNN.safetensors``): always the file that holds the
data, never a chain. Version 1 (one ``tensors.safetensors`` and one ``rows.safetensors``) is
still read.

The manifest is written last, after every file is complete and synced: a directory without one
is not a checkpoint. ``load`` checks every file's size and checksum before it returns anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adamps.checkpoint import schema as ckpt_schema
from adamps.optspec import OptimError, Optimizer, state_ranges

FORMAT = 2
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
ROWS = "rows.safetensors"
#: what a manifest's file entry may name: a file here, or one of a sibling checkpoint's (fullmatch)
_FILE_RE = ckpt_schema.FILE_RE


class CheckpointError(Exception):
    """A checkpoint that cannot be saved, read or restored; the message names the file."""


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    buf = memoryview(bytearray(1 << 20))  # one buffer, reused: no allocation per chunk
    with path.open("rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(buf[:k])
    return h.hexdigest()


def fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bucket_file(b: int) -> str:
    return f"bucket-{b:04d}.safetensors"


def write_file(path: Path, content: dict[str, np.ndarray]) -> dict[str, Any]:
    """One data file, complete and synced under its final name; its manifest entry. Written
    straight from the arrays' memory (a save's are views of the reply it received, issue 38
    item 7): no file image put together first, each array hashed as it is written, no
    second pass over the file. The layout is safetensors' own (``safetensors.numpy.save``:
    arrays by alignment then name, the header padded with spaces to 8 bytes), so every
    array is aligned to its elements."""
    arrays = {k: np.ascontiguousarray(a) for k, a in content.items()}
    order = sorted(arrays, key=lambda k: (-arrays[k].dtype.itemsize, k))
    header: dict[str, Any] = {}
    at = 0
    for k in order:
        a = arrays[k]
        name = _DTYPE_NAMES.get(a.dtype)
        if name is None:
            raise CheckpointError(f"{path}: array {k!r} is {a.dtype}, a checkpoint holds "
                                  f"{sorted(DTYPES)}")  # fmt: skip
        header[k] = {"dtype": name, "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    h = hashlib.sha256()
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for part in (len(text).to_bytes(8, "little") + text, *(arrays[k] for k in order)):
            view = memoryview(part).cast("B")
            h.update(view)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    tmp.replace(path)
    return {"bytes": 8 + len(text) + at, "sha256": h.hexdigest()}


def write_manifest(to: Path, fields: dict[str, Any]) -> dict[str, Any]:
    """The manifest, last, by rename: a crash before leaves no manifest, never a wrong one."""
    manifest = {"format": FORMAT, "created": time.time(), **fields}
    tmp = to / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, default=_plain))
    fsynced(tmp)
    tmp.replace(to / MANIFEST)
    return manifest


def write(
    to: Path, arrays: dict[str, np.ndarray], rows: dict[str, np.ndarray], fields: dict[str, Any]
) -> dict[str, Any]:
    """A version-1 checkpoint (whole tensors in one file): what earlier releases wrote, kept
    so that tests and tools can make one."""
    to.mkdir(parents=True, exist_ok=True)
    (to / MANIFEST).unlink(missing_ok=True)
    listing = {fname: write_file(to / fname, content)
               for fname, content in ((TENSORS, arrays), (ROWS, rows))}  # fmt: skip
    return write_manifest(to, {**fields, "format": 1, "files": listing})


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON: {type(x).__name__}")


def read_manifest(src: Path) -> dict[str, Any]:
    """The manifest of `src`, its format checked (CheckpointError naming the file)."""
    mpath = src / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: no manifest (not a checkpoint, or a save that failed)")
    try:
        manifest = ckpt_schema.parse(mpath)
    except ckpt_schema.SchemaError as exc:
        raise CheckpointError(f"{mpath}: {exc}") from None
    except OSError as exc:
        raise CheckpointError(f"{mpath}: cannot read: {exc.strerror or exc}") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if not isinstance(fmt, int) or fmt < 1:
        raise CheckpointError(f"{mpath}: field 'format' must be a positive int, got {fmt!r}")
    if fmt > FORMAT:
        raise CheckpointError(
            f"{mpath}: format version {fmt} is newer than this adamps reads ({FORMAT}); "
            "upgrade adamps"
        )
    try:
        ckpt_schema.check(manifest)
    except ckpt_schema.SchemaError as exc:
        raise CheckpointError(f"{mpath}: {exc}") from None
    return manifest


def checked_name(src: Path, name: str, want: Any) -> Path:
    """The path of file `name` of checkpoint `src`, `name` and its entry `want` well formed."""
    if not isinstance(name, str) or not _FILE_RE.fullmatch(name):
        raise CheckpointError(f"{src / MANIFEST}: file name {name!r} is not a checkpoint file")
    if not isinstance(want, dict) or not {"bytes", "sha256"} <= set(want):
        raise CheckpointError(f"{src / MANIFEST}: file {name}: needs 'bytes' and 'sha256'")
    return src / name


def checked_file(src: Path, name: str, want: Any) -> Path:
    """The path of file `name` of checkpoint `src`, its size and checksum those of `want`."""
    path = checked_name(src, name, want)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    size = path.stat().st_size
    if size != want["bytes"]:
        raise CheckpointError(
            f"{path}: truncated or altered: {size} bytes, the manifest says {want['bytes']}"
        )
    if sha256(path) != want["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from the manifest)")
    return path


def load(src: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The manifest and arrays of a checkpoint (``{tensor: values, "<tensor>/accum": ...}``,
    ``{row shard id: uint8 block}``), every file checked against the manifest first."""
    manifest = read_manifest(src)
    files = read_files(src, manifest)
    if manifest["format"] == 1:
        for fname in (TENSORS, ROWS):
            if fname not in manifest["files"]:
                raise CheckpointError(f"{src / MANIFEST}: lists no file {fname}")
        arrays, rows = files[TENSORS], files.get(ROWS, {})
    else:
        arrays, rows = assemble(src, manifest, files)
    for d in manifest.get("tensors", []):
        a = arrays.get(d["name"])
        if a is None or list(a.shape) != list(d["shape"]) or a.dtype != np.float32:
            raise CheckpointError(f"{src}: tensor {d['name']!r} missing or misshapen")
    return manifest, arrays, rows


#: files read and checked at once (sha256 and the reads release the GIL)
READERS = 4
#: safetensors dtypes a checkpoint's files hold
DTYPES = {"F32": np.dtype("<f4"), "U8": np.dtype("u1")}
_DTYPE_NAMES = {dt: name for name, dt in DTYPES.items()}


def read_files(src: Path, manifest: dict[str, Any]) -> dict[str, dict[str, np.ndarray]]:
    """Every file the manifest lists, read once into memory and checked (size, sha256), side by
    side: file name -> its arrays, views of the bytes read (no copy; issue 38 item 7: reading
    with safetensors' ``load_file`` copied every array, and hashing read each file again)."""
    names = list(manifest["files"].items())
    with ThreadPoolExecutor(max(1, min(READERS, len(names)))) as pool:
        got = list(pool.map(lambda nw: _read_checked(src, *nw), names))
    return {name: arrays for (name, _w), arrays in zip(names, got, strict=True)}


def _read_checked(src: Path, name: str, want: Any) -> dict[str, np.ndarray]:
    path = checked_name(src, name, want)
    try:
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"{path}: truncated or altered: {size} bytes, the manifest says {want['bytes']}"
            )
        buf = np.empty(size, np.uint8)  # no zero-filling: the read overwrites it
        with path.open("rb", buffering=0) as f:
            view, got = memoryview(buf), 0
            while got < size and (k := f.readinto(view[got:])):
                got += k
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if got != size:
        raise CheckpointError(f"{path}: truncated while read ({got} of {size} bytes)")
    if hashlib.sha256(buf).hexdigest() != want["sha256"]:
        raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from the manifest)")
    return safetensors_views(buf, path)


@dataclass(frozen=True, slots=True)
class Entry:
    """One array of a safetensors file: where its bytes are in the file, and what they hold."""

    offset: int
    nbytes: int
    dtype: np.dtype
    shape: tuple[int, ...]


#: a safetensors header is JSON of a few entries: one claiming more is not read into memory
#: (safetensors' own reader refuses headers over 100 MB)
MAX_SAFETENSORS_HEADER = 1 << 24


def safetensors_header(
    read: Callable[[int, int], bytes],
    size: int,
    path: Path,
    dtypes: dict[str, np.dtype] = DTYPES,
) -> tuple[bytes, dict[str, Entry]]:
    """The header bytes of a safetensors file of `size` bytes and its arrays' entries, every
    entry inside the file, of its dtype's size and aligned to its elements; `read(offset, n)`
    gives the file's bytes. The one parser of the format: a restore's streamed pass 1
    (stream.py) and ``load`` (``safetensors_views``) read the same files the same way. (The
    format: a u64 header length, a JSON header naming each array's dtype, shape and byte
    range in the data after it, the data.)"""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path}: not a safetensors file: {why}")

    first = read(0, 8)
    if len(first) < 8:
        raise bad("shorter than its header length")
    n = int.from_bytes(first, "little")
    if n > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise bad(f"a header of {n} bytes in a file of {size}")
    text = read(8, n)
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError) as exc:
        raise bad(f"its header: {exc}") from None
    if not isinstance(header, dict):
        raise bad("its header is not a map")
    start = 8 + n
    out: dict[str, Entry] = {}
    for key, rec in header.items():
        if key == "__metadata__":
            continue
        if isinstance(rec, dict) and rec.get("dtype") not in dtypes:  # else KeyError('F64')
            raise bad(
                f"entry {key!r}: dtype {str(rec.get('dtype'))[:20]!r}, not one of {sorted(dtypes)}"
            )
        try:
            dtype = dtypes[rec["dtype"]]
            shape = tuple(int(x) for x in rec["shape"])
            lo, hi = (int(x) for x in rec["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise bad(f"entry {key!r}: {exc!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not 0 <= lo <= hi <= size - start or hi - lo != count * dtype.itemsize:
            raise bad(f"entry {key!r}: bytes [{lo}, {hi}) for {count} x {dtype}")
        if (start + lo) % dtype.itemsize:
            raise bad(f"entry {key!r}: not aligned to its {dtype.itemsize}-byte elements")
        out[key] = Entry(start + lo, hi - lo, dtype, shape)
    return bytes(first) + bytes(text), out


def safetensors_views(buf: np.ndarray, path: Path) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file's bytes `buf`, as views of them (no copy)."""
    _head, entries = safetensors_header(
        lambda at, n: buf[at : at + n].tobytes(), int(buf.size), path
    )
    return {
        key: buf[e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
        for key, e in entries.items()
    }


def assemble(
    src: Path, manifest: dict[str, Any], files: dict[str, dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Version 2: each tensor put together from its shards in the checked `files`."""
    mpath = src / MANIFEST

    def piece(sid: str, rec: Any, key: str) -> np.ndarray:
        return shard_piece(mpath, files, sid, rec, key)

    arrays: dict[str, np.ndarray] = {}
    shards = manifest.get("shards", {})
    for d in manifest.get("tensors", []):
        name, shape = d["name"], tuple(d["shape"])
        size = int(np.prod(shape, dtype=np.int64))
        value = np.empty(size, np.float32)
        opt = _optimizer(d, mpath)
        mine = [(sid, rec) for sid, rec in shards.items() if rec.get("tensor") == name]
        spans = [(int(rec["start"]), int(rec["stop"])) for _sid, rec in mine]
        where = state_ranges(opt, spans) if opt is not None and opt.has_accumulator else None
        accum = None
        if where is not None:
            accum = np.zeros(max((hi for _lo, hi in where), default=0), np.float32)
        covered = 0
        for k, (sid, rec) in enumerate(mine):
            start, stop = spans[k]
            v = piece(sid, rec, sid)
            if v.size != stop - start or not 0 <= start < stop <= size:
                raise CheckpointError(
                    f"{mpath}: shard {sid!r}: {v.size} values for [{start}, {stop})"
                )
            value[start:stop] = v.reshape(-1)
            if accum is not None and where is not None and rec.get("accum"):
                lo, hi = where[k]
                a = piece(sid, rec, f"{sid}/accum").reshape(-1)
                if a.size != hi - lo:
                    raise CheckpointError(
                        f"{mpath}: shard {sid!r}: an optimizer state of {a.size} elements, "
                        f"{opt.kind if opt else '?'} keeps {hi - lo}"
                    )
                accum[lo:hi] = a
            covered += stop - start
        if covered != size:
            raise CheckpointError(
                f"{mpath}: tensor {name!r}: its shards cover {covered} of {size} elements"
            )
        arrays[name] = value.reshape(shape)
        if accum is not None:
            # the legacy Adagrad's accumulator is shaped like the tensor; the torch kinds'
            # states are flat (optspec.state_ranges)
            arrays[f"{name}/accum"] = accum.reshape(shape) if accum.size == size else accum
    rows = {sid: piece(sid, rec, sid) for sid, rec in manifest.get("row_shards", {}).items()}
    return arrays, rows


def shard_piece(
    mpath: Path, files: dict[str, dict[str, np.ndarray]], sid: str, rec: Any, key: str
) -> np.ndarray:
    """Array `key` of shard `sid` (its manifest record `rec`) from the file it names."""
    content = files.get(rec.get("file")) if isinstance(rec, dict) else None
    if content is None or key not in content:
        raise CheckpointError(f"{mpath}: shard {sid!r}: {key!r} is in no listed file")
    return content[key]


def _optimizer(d: dict[str, Any], mpath: Path) -> Optimizer | None:
    """A tensor definition's optimizer (a definition written before the torch kinds reads as
    the legacy Adagrad, optspec.py); None without one."""
    if not d.get("optimizer"):
        return None
    try:
        return Optimizer.from_dict(d["optimizer"])
    except OptimError as exc:
        raise CheckpointError(f"{mpath}: tensor {d.get('name')!r}: {exc}") from None


def referenced(src: Path) -> set[Path]:
    """The files (resolved) checkpoint `src`'s manifest names; empty without a manifest."""
    try:
        manifest = read_manifest(src)
    except CheckpointError:
        return set()
    return {(src / name).resolve() for name in manifest["files"]}
