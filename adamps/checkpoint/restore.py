"""``adamps checkpoint restore``: a checkpoint onto a cluster of any size (issue 24), checked
whole before the first write, then installed bucket by bucket on each primary with
``ckpt_install`` (the servers' one write path).

Onto a cluster that holds some of the checkpoint's tensors (``--force``: a rollback of a live
run) those tensors keep their definitions (init, optimizer: their trainers created them) and
take the checkpoint's values; only their shape and dtype must match (issue 39)."""

from __future__ import annotations

import itertools
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from adamps.checkpoint.cluster import Cluster
from adamps.checkpoint.format import (
    MANIFEST,
    ROWS,
    TENSORS,
    CheckpointError,
    assemble,
    read_files,
    read_manifest,
)
from adamps.checkpoint.stream import Piece, Stream
from adamps.client.ps import PSClient
from adamps.layout import Layout, TensorSpec
from adamps.optspec import OptimError, Optimizer, state_ranges
from adamps.tables import ROWS_SEP
from adamps.wire.protocol import ProtocolError

#: buckets installed at once per server (their primaries and replication rounds are
#: independent; each worker thread has its own data-plane connection to each server)
PER_SERVER = 3
#: most bytes of shards per ckpt_install request (and half the servers' max_body at most): a
#: bucket of a 1 GB model on 16 buckets (64 MB) is one request, one two-phase commit round
INSTALL_CHUNK = 128 << 20


def restore(cluster: Cluster, src: Path, force: bool = False) -> dict[str, Any]:
    """The checkpoint in `src` onto the cluster: checked whole first, then installed bucket by
    bucket on each primary (which replicates it)."""
    t0 = time.perf_counter()
    manifest = saved = read_manifest(src)
    signed, widths = _signed(manifest), _row_widths(manifest)
    arrays: dict[str, np.ndarray] | None = None
    stream: Stream | None = None
    if manifest["format"] == 1:
        arrays, rows = _v1(src, manifest, read_files(src, manifest))
        damaged = _check_state(src, arrays, rows, signed, widths)
    else:
        # every file hashed and every value bounded before the first write, in blocks
        stream = Stream(src, manifest)
        refs, rows = _check_stream(src, manifest, stream, signed)
        damaged = _check_state(src, {}, rows, signed, widths)
    statuses = cluster.server_status()
    if not statuses:
        raise CheckpointError("the cluster has no parameter server to restore onto")
    n_buckets = int(statuses[0]["n_buckets"])
    max_shard = int(statuses[0]["config"]["max_shard_elems"])
    if rows and n_buckets != manifest.get("n_buckets"):
        raise CheckpointError(
            f"{src / MANIFEST}: layout mismatch: the checkpoint's embedding rows are hashed "
            f"into {manifest.get('n_buckets')} buckets, the cluster has {n_buckets}"
        )
    held = sorted({n for s in statuses for n in s.get("tensors", {})})
    if held and not force:
        more = f" and {len(held) - 5} more" if len(held) > 5 else ""  # the first 5 only: not all
        raise CheckpointError(
            f"the cluster already holds tensors {held[:5]}{more}: restore onto an empty cluster, "
            "or pass --force to overwrite"
        )
    tensors_held, tables_held = _definitions(cluster)
    # Rows too: a table the cluster holds was found by the first install of one of its
    # buckets (`409 conflict ... restore with force`), after the creates and other buckets'
    # installs had been written.
    both = sorted(t["name"] for t in manifest["tables"] if t["name"] in tables_held)
    if both and not force:
        more = f" and {len(both) - 5} more" if len(both) > 5 else ""
        raise CheckpointError(
            f"the cluster already holds tables {both[:5]}{more}: restore onto an empty cluster, "
            "or pass --force to overwrite their rows"
        )
    # A tensor or table the cluster holds keeps its definition (init, optimizer, admission:
    # its trainers created it, and a create with the checkpoint's would be `exists`); only
    # what decides where the values go must match, checked before the first write.
    for d in manifest["tensors"]:
        have = tensors_held.get(d["name"])
        if have is None:
            continue
        for key, mine in (("shape", list(d["shape"])), ("dtype", d.get("dtype", "float32"))):
            if have.get(key) != mine:
                what = "" if key == "shape" else "of dtype "
                raise CheckpointError(
                    f"{src / MANIFEST}: layout mismatch: tensor {d['name']!r} is {what}{mine} in "
                    f"the checkpoint, {what}{have.get(key)} on the cluster: nothing restored"
                )
    for t in manifest["tables"]:
        have = tables_held.get(t["name"])
        if have is not None and have.get("dim") != t["dim"]:
            raise CheckpointError(
                f"{src / MANIFEST}: layout mismatch: table {t['name']!r} has dim {t['dim']} in "
                f"the checkpoint, {have.get('dim')} on the cluster: nothing restored"
            )
        if have is not None:
            _check_row_state(src, t, have)
    # The cluster's tensors under another optimizer than the checkpoint's take its values only
    # and start their optimizer state afresh (docs/operations.md): the checkpoint's state was
    # sent anyway, and the first such shard's install failed with bad_shape after the creates
    # and other buckets' installs.
    fresh = _other_optimizer(manifest, tensors_held)
    if fresh:
        manifest = {**manifest, "tensors": [
            {**d, "optimizer": tensors_held[d["name"]].get("optimizer")} if d["name"] in fresh
            else d for d in manifest["tensors"]
        ]}  # fmt: skip
        if arrays is not None:
            arrays = _without_state(arrays, fresh)
        if stream is not None:
            tensor_of = {sid: r.get("tensor") for sid, r in manifest.get("shards", {}).items()}
            refs = {sid: (v, None if tensor_of.get(sid) in fresh else a)
                    for sid, (v, a) in refs.items()}  # fmt: skip
    if damaged:
        sid, why = damaged[0]
        raise CheckpointError(f"{src}: row shard {sid}: not a row block: {why}: nothing restored")
    specs = [TensorSpec(d["name"], tuple(d["shape"])) for d in manifest["tensors"]]
    layout = Layout(specs, n_buckets=n_buckets, max_shard_elems=max_shard)
    # Zeros: a definition the servers write without a pass over the values (catalog.py); the
    # install fills them. All of them in one call per server (one synced LMDB commit).
    cluster.create_tensors(
        [_create_fields(d) for d in manifest["tensors"] if d["name"] not in tensors_held],
        n_buckets,
    )
    client = PSClient(cluster.source, layout, cluster.token, retry_for=cluster.retry_for)
    try:
        for t in manifest["tables"]:
            if t["name"] not in tables_held:
                client.create_table(
                    t["name"], t["dim"], init=t.get("init"), optimizer=t.get("optimizer"),
                    admission=t.get("admission"), dtype=t.get("dtype"),
                )  # fmt: skip
    finally:
        client.close()
    chunk = min(INSTALL_CHUNK, int(statuses[0]["config"].get("max_body", 256 << 20)) // 2)
    workers = PER_SERVER * len(statuses)
    direct = None if stream is None else _direct(manifest, refs, layout)
    if direct is not None:
        # The checkpoint's shards are the cluster's: each request's shards are read from their
        # files into the sending thread's buffer and sent as raw payloads (issue 38 item 7),
        # nothing put together or copied.
        installed = send(cluster, layout.n_buckets, direct, _row_records(rows, manifest),
                         force, chunk, workers, stream)  # fmt: skip
        return {"installed": installed, "seconds": time.perf_counter() - t0, "direct": True}
    if arrays is None:  # another shard size or bucket count: the tensors whole, then cut anew
        arrays, rows = assemble(src, saved, read_files(src, saved))
        _check_shapes(src, saved, arrays)
        arrays = _without_state(arrays, fresh)
    versions = _versions(manifest, layout)
    installed = install(
        cluster, layout, manifest["tensors"], arrays, rows, force, versions, chunk, workers
    )
    return {"installed": installed, "seconds": time.perf_counter() - t0, "direct": False}


def _create_fields(d: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's tensor definition as create's fields, of zeros."""
    out = {"name": d["name"], "shape": list(d["shape"]), "init": {"kind": "zeros"}}
    if d.get("optimizer"):
        out["optimizer"] = d["optimizer"]
    return out


def _v1(
    src: Path, manifest: dict[str, Any], files: dict[str, dict[str, np.ndarray]]
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A version-1 checkpoint's whole tensors and rows (one file each)."""
    for fname in (TENSORS, ROWS):
        if fname not in manifest["files"]:
            raise CheckpointError(f"{src / MANIFEST}: lists no file {fname}")
    arrays, rows = files[TENSORS], files.get(ROWS, {})
    _check_shapes(src, manifest, arrays)
    return arrays, rows


def _check_shapes(src: Path, manifest: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    for d in manifest.get("tensors", []):
        a = arrays.get(d["name"])
        if a is None or list(a.shape) != list(d["shape"]) or a.dtype != np.float32:
            raise CheckpointError(f"{src}: tensor {d['name']!r} missing or misshapen")


def _check_stream(
    src: Path, manifest: dict[str, Any], stream: Stream, signed: set[str]
) -> tuple[dict[str, tuple[Piece, Piece | None]], dict[str, np.ndarray]]:
    """Pass 1 over a version-2 checkpoint's files (ckpt_stream.Stream.check): every value and
    optimizer state the manifest names is bounded (the checks and messages of _check_state),
    every shard's arrays are where the manifest says and of its size. Returns per dense shard
    its (values, state or None) pieces, and the row shards' blocks (read whole)."""
    # Imported here, not at the top: the servers' modules are a restore's alone, which every
    # controller would load at its start (it imports this module through its checkpoint
    # schedule, to save). bounds no longer brings the optimizers' numba kernels (compiled at
    # import: a second of a 3.5 s restore of 0.25 GB; issue 38 item 7).
    from adamps.server.updates import bounds

    mpath = src / MANIFEST
    shards = manifest.get("shards", {})
    what: dict[tuple[Any, str], tuple[str, bool]] = {}
    for sid, rec in shards.items():
        what[(rec.get("file"), sid)] = (str(rec.get("tensor")), False)
        if rec.get("accum"):
            what[(rec.get("file"), f"{sid}/accum")] = (str(rec.get("tensor")), True)

    def part(name: str, key: str, a: np.ndarray) -> None:
        t, accum = what.get((name, key), (None, False))
        if t is None:
            return  # an array no shard of this checkpoint takes (a base's, since replaced)
        if accum:
            bounds.check_state(f"tensor {t!r}", a[:0], a, t in signed)
        else:
            bounds.check_state(f"tensor {t!r}", a)

    try:
        stream.check(part)
    except ProtocolError as exc:
        raise CheckpointError(f"{src}: {exc.message}: nothing restored") from None
    refs: dict[str, tuple[Piece, Piece | None]] = {}
    for sid, rec in shards.items():
        v = stream.piece(rec.get("file"), sid, f"shard {sid!r}")
        start, stop = int(rec["start"]), int(rec["stop"])
        if v.size != stop - start:
            raise CheckpointError(f"{mpath}: shard {sid!r}: {v.size} values for [{start}, {stop})")
        a = (
            stream.piece(rec["file"], f"{sid}/accum", f"shard {sid!r}")
            if rec.get("accum")
            else None
        )
        refs[sid] = (v, a)
    rows = {}
    for sid, rec in manifest.get("row_shards", {}).items():
        (block,) = stream.read([stream.piece(rec.get("file"), sid, f"row shard {sid!r}")])
        rows[sid] = block.copy()  # the buffer is reused
    return refs, rows


def _direct(
    manifest: dict[str, Any], refs: dict[str, tuple[Piece, Piece | None]], layout: Layout
) -> dict[int, list[tuple[str, dict[str, Any]]]] | None:
    """Per bucket of `layout`, its shards' install records (pieces of the files, read when
    sent), when the checkpoint's shards are the layout's (same ids and ranges: the same bucket
    count and shard size) and each tensor's shards all carry the optimizer's state or none
    does (with none its state would be zeros, as put together); else None."""
    saved = manifest.get("shards", {})
    defs = {d["name"]: d for d in manifest["tensors"]}
    out: dict[int, list[tuple[str, dict[str, Any]]]] = {}
    for name, shards in layout.shards_of.items():
        recs = [saved.get(s.id) for s in shards]
        if any(not isinstance(r, dict) or (r.get("tensor"), r.get("start"), r.get("stop"))
               != (name, s.start, s.stop) for r, s in zip(recs, shards, strict=True)):  # fmt: skip
            return None
        d = defs[name]
        opt = Optimizer.from_dict(d["optimizer"]) if d.get("optimizer") else None
        keeps = opt is not None and opt.has_accumulator
        if any((refs[s.id][1] is not None) != keeps for s in shards):
            return None
        spans = [(s.start, s.stop) for s in shards]
        where = state_ranges(opt, spans) if keeps and opt is not None else spans
        for s, r, (lo, hi) in zip(shards, recs, where, strict=True):
            v, a = refs[s.id]
            rec: dict[str, Any] = {"v": v}
            if a is not None:
                if a.size != hi - lo:
                    raise CheckpointError(
                        f"{MANIFEST}: shard {s.id!r}: an optimizer state of {a.size} elements, "
                        f"{opt.kind if opt else '?'} keeps {hi - lo}"
                    )
                rec["a"] = a
            if "version" in r:
                rec["n"] = r["version"]
            out.setdefault(layout.bucket_of[s.id], []).append((s.id, rec))
    return out


def _row_records(rows: dict[str, np.ndarray], manifest: dict[str, Any]) -> dict[int, Any]:
    """Per bucket its row shards' install records (the block's bytes, the saved version)."""
    saved = manifest.get("row_shards", {})
    out: dict[int, dict[str, Any]] = {}
    for sid, a in rows.items():
        rec: dict[str, Any] = {"b": _block(a)}
        if "version" in saved.get(sid, {}):
            rec["n"] = saved[sid]["version"]
        out.setdefault(int(sid.rsplit("/", 1)[1]), {})[sid] = rec
    return out


def _block(a: np.ndarray) -> np.ndarray:
    """A row block as the uint8 array ckpt_install takes as a raw payload (no bytes copy)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _signed(manifest: dict[str, Any]) -> set[str]:
    """The tensors, and the tables as ``<table>#rows/``, whose optimizer state may hold negative
    values (Optimizer.signed_state: Adam's first moments, sparse_adam's on rows)."""
    out = set()
    tables = [{**t, "name": t.get("name", "") + ROWS_SEP} for t in manifest.get("tables", [])]
    for d in [*manifest.get("tensors", []), *tables]:
        try:
            if d.get("optimizer") and Optimizer.from_dict(d["optimizer"]).signed_state:
                out.add(d["name"])
        except (OptimError, TypeError, ValueError) as exc:
            raise CheckpointError(f"tensor {d.get('name')!r}: bad optimizer: {exc}") from None
    return out


def _row_widths(manifest: dict[str, Any]) -> dict[str, int]:
    """Each table's optimizer state per row (float32), as its row blocks hold it."""
    out = {}
    for t in manifest.get("tables", []):
        try:
            opt = Optimizer.from_dict(t.get("optimizer") or {"kind": "sgd"})
            out[t["name"]] = opt.row_state_width(int(t["dim"]))
        except (OptimError, TypeError, ValueError) as exc:
            raise CheckpointError(f"table {t.get('name')!r}: bad optimizer: {exc}") from None
    return out


def _check_state(
    src: Path,
    arrays: dict[str, np.ndarray],
    rows: dict[str, np.ndarray],
    signed: set[str],
    widths: dict[str, int],
) -> list[tuple[str, str]]:
    """Every value and accumulator of the checkpoint is one a server installs (finite and
    bounded, bounds.check_state; each server checks its part again), checked from the files
    alone before any request, so a NaN in bucket 7 cannot leave buckets 0-6 restored. Returns
    the row shards whose blocks do not parse (refused after the layout checks, which name a
    foreign checkpoint's real problem first)."""
    from adamps.server.updates import bounds  # here: see _check_stream

    if rows:  # (the row blocks' module brings the optimizers' kernels: only for rows)
        from adamps.server.store.tables import rowblock
    damaged = []
    try:
        for name, a in arrays.items():
            if name.endswith("/accum"):
                t = name[: -len("/accum")]
                bounds.check_state(f"tensor {t!r}", a[:0], a, t in signed)
            else:
                bounds.check_state(f"tensor {name!r}", a)
        for sid, block in rows.items():
            try:
                table = sid.split(ROWS_SEP, 1)[0]
                values, accum = rowblock.RowBlock.state_of(block.tobytes(), widths.get(table, 0))
            except (ValueError, struct.error) as exc:
                damaged.append((sid, str(exc)))
                continue
            signed_rows = table + ROWS_SEP in signed
            bounds.check_state(f"row shard {sid!r}", values, accum, signed_rows)
    except ProtocolError as exc:
        raise CheckpointError(f"{src}: {exc.message}: nothing restored") from None
    return damaged


def _versions(manifest: dict[str, Any], layout: Layout) -> dict[str, int]:
    """The version each shard of the target layout takes: the checkpoint's, for a shard the
    checkpoint holds with the same range (a target of another max_shard_elems cuts other
    shards, which count afresh); every row shard's (n_buckets is the checkpoint's)."""
    out: dict[str, int] = {}
    saved = manifest.get("shards", {})
    for name, shards in layout.shards_of.items():
        for s in shards:
            rec = saved.get(s.id)
            if rec and (rec.get("tensor"), rec.get("start"), rec.get("stop")) == (
                name, s.start, s.stop
            ) and "version" in rec:  # fmt: skip
                out[s.id] = rec["version"]
    for sid, rec in manifest.get("row_shards", {}).items():
        if "version" in rec:
            out[sid] = rec["version"]
    return out


def _check_row_state(src: Path, saved: dict[str, Any], have: dict[str, Any]) -> None:
    """A held table's row blocks are installed whole: the cluster's must hold the same row
    layout (optimizer state per row, dtype) as the checkpoint's. Another one was refused by
    the first row install ("not a row block") after the creates and other buckets' installs."""

    def layout(t: dict[str, Any]) -> tuple[str, int, str]:
        try:
            opt = Optimizer.from_dict(t.get("optimizer") or {"kind": "sgd"})
            return opt.kind, opt.row_state_width(int(t["dim"])), str(t.get("dtype") or "float32")
        except (OptimError, TypeError, ValueError, KeyError) as exc:
            raise CheckpointError(f"table {t.get('name')!r}: bad optimizer: {exc}") from None

    (k1, w1, d1), (k2, w2, d2) = layout(saved), layout(have)
    if (w1, d1) != (w2, d2):
        raise CheckpointError(
            f"{src / MANIFEST}: layout mismatch: table {saved['name']!r} keeps {w1} floats of "
            f"optimizer state per row ({k1}) of dtype {d1} in the checkpoint, {w2} ({k2}) of "
            f"dtype {d2} on the cluster: nothing restored (its values only: adamps table load "
            f"--table {saved['name']} --from {src})"
        )


def _without_state(arrays: dict[str, np.ndarray], names: set[str]) -> dict[str, np.ndarray]:
    """`arrays` less the optimizer state (``<name>/accum``) of the tensors `names`."""
    return {k: a for k, a in arrays.items() if not (k.endswith("/accum") and k[:-6] in names)}


def _other_optimizer(manifest: dict[str, Any], held: dict[str, Any]) -> set[str]:
    """The checkpoint's tensors the cluster holds under another optimizer kind (or another
    state size): they are restored without the checkpoint's optimizer state."""
    out = set()
    for d in manifest["tensors"]:
        have = held.get(d["name"])
        if have is None:
            continue
        try:
            mine = Optimizer.from_dict(d.get("optimizer") or {"kind": "sgd"})
            theirs = Optimizer.from_dict(have.get("optimizer") or {"kind": "sgd"})
        except (OptimError, TypeError, ValueError):
            out.add(d["name"])
            continue
        if mine.kind != theirs.kind or mine.state_size(1024) != theirs.state_size(1024):
            out.add(d["name"])
    return out


def _definitions(cluster: Cluster) -> tuple[dict[str, Any], dict[str, Any]]:
    """The tensor and table definitions the cluster's servers hold, by name."""
    tensors: dict[str, Any] = {}
    tables: dict[str, Any] = {}
    for _url, rpc in cluster.live_servers():
        for d in rpc.call("list")["tensors"]:
            tensors.setdefault(d["name"], d)
        for t in rpc.call("list_tables")["tables"]:
            tables.setdefault(t["name"], t)
    return tensors, tables


def install(
    cluster: Cluster,
    layout: Layout,
    tensors: list[dict[str, Any]],
    arrays: dict[str, np.ndarray],
    rows: dict[str, np.ndarray] | None = None,
    force: bool = False,
    versions: dict[str, int] | None = None,
    chunk: int = INSTALL_CHUNK,
    workers: int = 4,
) -> int:
    """Installs the values (and ``<name>/accum`` accumulators) of `tensors` (definitions with
    a ``name``) and the row shards `rows` bucket by bucket on each primary with
    ``ckpt_install`` over the servers' data planes (the arrays as raw payloads), through the
    one write path; returns the shards installed. The tensors
    exist already (created with any values: an install overwrites them). A shard named in
    `versions` takes that version (the checkpoint's) unless its own is already higher."""
    rows = rows or {}
    versions = versions or {}
    per_bucket: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for d in tensors:
        name = d["name"]
        flat = arrays[name].reshape(-1)
        acc = arrays.get(f"{name}/accum")
        accf = None if acc is None else acc.reshape(-1)
        shards = layout.shards_of[name]
        where = [(s.start, s.stop) for s in shards]
        if accf is not None and d.get("optimizer"):
            # each shard's part of the tensor's whole optimizer state (ckpt_format._assemble)
            where = state_ranges(Optimizer.from_dict(d["optimizer"]), where)
        for s, (lo, hi) in zip(shards, where, strict=True):
            rec: dict[str, Any] = {"v": np.ascontiguousarray(flat[s.start : s.stop])}
            if accf is not None:
                rec["a"] = np.ascontiguousarray(accf[lo:hi])
            if s.id in versions:
                rec["n"] = versions[s.id]
            per_bucket.setdefault(layout.bucket_of[s.id], []).append((s.id, rec))
    row_bucket: dict[int, dict[str, Any]] = {}
    for sid, a in rows.items():
        b = int(sid.rsplit("/", 1)[1])
        row_bucket.setdefault(b, {})[sid] = {"b": _block(a)}
        if sid in versions:
            row_bucket[b][sid]["n"] = versions[sid]
    return send(cluster, layout.n_buckets, per_bucket, row_bucket, force, chunk, workers)


def _read_part(stream: Stream, part: dict[str, Any]) -> dict[str, Any]:
    """A request's records with their pieces read (views of this thread's buffer)."""
    keys = [(sid, k) for sid, rec in part.items() for k in ("v", "a") if k in rec]
    arrays = stream.read([part[sid][k] for sid, k in keys])
    out = {sid: dict(rec) for sid, rec in part.items()}
    for (sid, k), arr in zip(keys, arrays, strict=True):
        out[sid][k] = arr.reshape(-1)
    return out


def send(
    cluster: Cluster,
    n_buckets: int,
    per_bucket: dict[int, list[tuple[str, dict[str, Any]]]],
    row_bucket: dict[int, dict[str, Any]],
    force: bool,
    chunk: int,
    workers: int,
    stream: Stream | None = None,
) -> int:
    """The install records of each bucket (dense shards ``{v, a, n}``, row shards ``{b, n}``)
    to its primary with ``ckpt_install`` over its data plane (every array a raw payload, row
    blocks too: issue 38 item 7), in requests of up to `chunk` bytes, buckets side by side;
    returns the shards installed. With `stream`, ``v`` and ``a`` are pieces of its files, read
    into the sending thread's buffer just before their request."""

    def install_bucket(b: int) -> int:
        # Requests of up to `chunk` bytes: the dense shards', then the row shards' (each whole)
        chunks: list[tuple[str, dict[str, Any]]] = []
        size, cur, kind = 0, {}, "shards"
        records = [("shards", sid, rec) for sid, rec in per_bucket.get(b, [])]
        records += [("rows", sid, rec) for sid, rec in row_bucket.get(b, {}).items()]
        for k, sid, rec in records:
            nbytes = sum(rec[f].nbytes for f in ("v", "a", "b") if f in rec)
            if cur and (size + nbytes > chunk or k != kind):
                chunks.append((kind, cur))
                cur, size = {}, 0
            cur[sid], kind = rec, k
            size += nbytes
        if cur:
            chunks.append((kind, cur))
        n = 0
        # A retried install may find its own first attempt applied (the outcome of a timed-out
        # or failed-over request is unknown). It carries the same (client, seq), which the
        # bucket's replicas recognize (their dedup table travels with the batches), so it is
        # applied once: the shards keep the checkpoint's version, not one more. It also forces,
        # for the case of an attempt applied but not recorded; a first attempt on a shard that
        # took updates is refused by the server.
        for kind, part in chunks:
            if stream is not None and kind == "shards":
                part = _read_part(stream, part)
            seq = next(seqs)
            cluster.on_primary(
                b,
                lambda r, k, c=part, f=kind, q=seq: cluster.message(
                    r, "ckpt_install", bucket=b, force=force or k > 1, client=client, seq=q,
                    **{f: c},
                ),
            )  # fmt: skip
            n += len(part)
        return n

    client = f"restore-{os.urandom(8).hex()}"
    seqs = itertools.count(1)  # (next() on it is atomic under the GIL: the threads share it)

    # Buckets installed in parallel: their primaries and replication rounds are independent.
    with ThreadPoolExecutor(max(1, min(workers, n_buckets))) as pool:
        installed = sum(pool.map(install_bucket, range(n_buckets)))
    return installed
