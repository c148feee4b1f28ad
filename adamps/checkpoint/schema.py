"""What a checkpoint's ``manifest.json`` may hold, checked before anything is allocated or sent
(issue 39): a manifest is input from a file anyone may have written, so a hostile or damaged
one (a tensor claiming 1e12 elements, JSON nested 200,000 deep, a shard whose ``start`` is a
string) is refused with a message naming the field, never a traceback or a 4 TB allocation.

The bounds need no configuration: the manifest's file is read only up to ``MAX_MANIFEST_BYTES``,
and the tensors' elements must fit in the data files the manifest lists (each value is a
float32 in one of them), so a tensor can never claim more memory than the checkpoint's files
hold. Fields written by earlier releases that a later one added are optional; a field present
must have its type.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from adamps.wire.limits import MAX_DIMS, MAX_VERSION

#: a manifest larger than this is refused unread (a model of a million shards writes ~200 MB)
MAX_MANIFEST_BYTES = 256 << 20
#: what a manifest's file entry may name: a file here, or one of a sibling checkpoint's
FILE_RE = re.compile(r"^(\.\./[A-Za-z0-9_.-]+/)?[A-Za-z0-9_.-]+\.safetensors$")
#: the most buckets any cluster has (adamps/wire/limits.py bounds n_buckets far below this)
MAX_BUCKETS = 1 << 20


class SchemaError(ValueError):
    """A manifest field that is missing or of the wrong kind; the message names it."""


def parse(path: Path) -> Any:
    """The JSON of `path`, its size bounded before it is read and its depth by the parser."""
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise SchemaError(
            f"{size} bytes, more than a manifest may have ({MAX_MANIFEST_BYTES}): not a checkpoint"
        )
    with path.open("rb") as f:
        # read(n) allocates n bytes first: the file's size (bounded above), not the bound
        raw = f.read(size + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise SchemaError(f"more than a manifest may have ({MAX_MANIFEST_BYTES} bytes)")
    try:
        return json.loads(raw)
    except RecursionError:
        raise SchemaError("not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise SchemaError(f"not valid JSON: {exc}") from None


def _int(v: Any, where: str, lo: int = 0, hi: int | None = None) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        bound = f"an int >= {lo}" if hi is None else f"an int in [{lo}, {hi}]"
        raise SchemaError(f"field {where} must be {bound}, got {_short(v)}")
    return v


def _kind(v: Any, typ: type, where: str) -> Any:
    if not isinstance(v, typ):
        raise SchemaError(f"field {where} must be a JSON {_NAMES[typ]}, got {_short(v)}")
    return v


_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean"}


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else f"{text[:37]}..."


def check(m: Any) -> None:
    """Raises SchemaError naming the first field of manifest `m` (a parsed JSON value whose
    ``format`` is already checked) that does not fit."""
    files = _kind(m.get("files"), dict, "'files'")
    total_bytes = 0
    for name, f in files.items():
        if not FILE_RE.fullmatch(name):
            raise SchemaError(f"file name {name!r} is not a checkpoint file")
        _kind(f, dict, f"files[{name!r}]")
        total_bytes += _int(f.get("bytes"), f"files[{name!r}].bytes")
        _kind(f.get("sha256"), str, f"files[{name!r}].sha256")
    if "n_buckets" in m:
        _int(m["n_buckets"], "'n_buckets'", 1, MAX_BUCKETS)
    if "max_shard_elems" in m:
        _int(m["max_shard_elems"], "'max_shard_elems'", 1)
    elements = 0
    names: set[str] = set()
    for i, d in enumerate(_kind(m.get("tensors", []), list, "'tensors'")):
        _kind(d, dict, f"tensors[{i}]")
        name = _kind(d.get("name"), str, f"tensors[{i}].name")
        if name in names:
            raise SchemaError(f"tensor {name!r} is listed twice")
        names.add(name)
        shape = _kind(d.get("shape"), list, f"tensor {name!r}: shape")
        if not 1 <= len(shape) <= MAX_DIMS:
            raise SchemaError(f"tensor {name!r}: shape must have 1..{MAX_DIMS} dimensions")
        for k, n in enumerate(shape):
            _int(n, f"tensor {name!r}: shape[{k}]", 1)
        _kind(d.get("optimizer", {}), dict, f"tensor {name!r}: optimizer")
        elements += math.prod(shape)
    # Every value is a float32 in one of the listed files (whose sizes load() checks against
    # the files themselves), so this bounds what a restore allocates by what is on disk.
    if 4 * elements > total_bytes:
        raise SchemaError(
            f"the tensors claim {elements} elements ({4 * elements} bytes of float32), more than "
            f"the checkpoint's files hold ({total_bytes} bytes)"
        )
    for i, t in enumerate(_kind(m.get("tables", []), list, "'tables'")):
        _kind(t, dict, f"tables[{i}]")
        tname = _kind(t.get("name"), str, f"tables[{i}].name")
        _int(t.get("dim"), f"table {tname!r}: dim", 1)
    for sid, r in _kind(m.get("shards", {}), dict, "'shards'").items():
        where = f"shard {sid!r}"
        _kind(r, dict, where)
        _kind(r.get("tensor"), str, f"{where}: tensor")
        _kind(r.get("file"), str, f"{where}: file")
        _int(r.get("start"), f"{where}: start")
        _int(r.get("stop"), f"{where}: stop")
        _kind(r.get("accum", False), bool, f"{where}: accum")
        _int(r.get("version", 0), f"{where}: version", 0, MAX_VERSION)
    for sid, r in _kind(m.get("row_shards", {}), dict, "'row_shards'").items():
        where = f"row shard {sid!r}"
        _kind(r, dict, where)
        _kind(r.get("file"), str, f"{where}: file")
        _int(r.get("version", 0), f"{where}: version", 0, MAX_VERSION)
        if "/" not in sid or not sid.rsplit("/", 1)[1].isdigit():
            raise SchemaError(f"{where}: the id must end in /<bucket>")
