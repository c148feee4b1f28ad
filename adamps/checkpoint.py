"""``adamps checkpoint save|restore``: a model's state out of one running cluster and into
another of any size (issue 24).

The format (version 1), readable without adamps (docs/operations.md shows how):

- ``manifest.json``: ``format``, ``n_buckets``, the tensors' and tables' definitions, per file
  its size and sha256, and per bucket the cut ``{epoch, seq}`` its state was read at (``seq``
  is the bucket's committed replication position on its primary), ``consistent``: false
  (each bucket is cut on its own: the cuts are not one instant across buckets);
- ``tensors.safetensors``: each tensor's values under its name, its Adagrad accumulator
  (when its optimizer keeps one) under ``<name>/accum``, float32 in the tensor's shape;
- ``rows.safetensors``: each embedding-table row shard (``<table>#rows/<bucket>``) as the
  uint8 bytes of its row block (ids, values, accumulators; rowblock.py).

The manifest is written last, after every file is complete and synced: a directory without
one is not a checkpoint. ``restore`` checks everything (format version, every file's size and
checksum, the layout against the target cluster, the target's emptiness) before its first
write; its writes go through the servers' one write path (``ckpt_install``)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import load_file, save_file

from adamps import retry
from adamps.client import ControllerRouting, PSClient, Routing, retryable
from adamps.layout import Layout, TensorSpec
from adamps.rpc import RpcError, SyncRpc

FORMAT = 1
MANIFEST = "manifest.json"
TENSORS = "tensors.safetensors"
ROWS = "rows.safetensors"
#: buckets read at once by a save
READERS = 4
#: bytes of shards per ckpt_install request (under the servers' max_body)
INSTALL_CHUNK = 32 << 20


class CheckpointError(Exception):
    """A checkpoint that cannot be saved, read or restored; the message names the file."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsynced(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Cluster:
    """The controllers' routing and one connection per server (the operator's side)."""

    def __init__(self, controllers: list[str], token: str | None, retry_for: float = 60.0):
        self.controllers = controllers
        self.token = token if token is not None else os.environ.get("ADAMPS_TOKEN")
        self.source = ControllerRouting(controllers)
        self.retry_for = retry_for
        #: one connection per server and thread (a SyncRpc is one keep-alive connection)
        self._local = threading.local()
        self._all: list[SyncRpc] = []
        self._lock = threading.Lock()

    def rpc(self, url: str) -> SyncRpc:
        rpcs = getattr(self._local, "rpcs", None)
        if rpcs is None:
            rpcs = self._local.rpcs = {}
        if url not in rpcs:
            rpcs[url] = SyncRpc(url, self.token, 60.0)
            with self._lock:
                self._all.append(rpcs[url])
        return rpcs[url]

    def routing(self) -> Routing:
        return self.source.fetch(self.rpc)

    def on_primary(self, b: int, fn: Callable[[SyncRpc, int], Any]) -> Any:
        """fn(rpc of bucket b's primary, attempt number), again on a fresh routing table after
        a failover."""

        def attempt(n: int) -> Any:
            route = self.routing().routes.get(b)
            if route is None:
                raise RpcError("unavailable", f"bucket {b} has no primary")
            return fn(self.rpc(route.primary), n)

        return retry.call(retry.RetryPolicy(self.retry_for), attempt, retryable)

    def server_status(self) -> list[dict[str, Any]]:
        return [self.rpc(u).get_json("/status") for u in self.routing().servers()]

    def controller_json(self, path: str) -> Any:
        for url in self.controllers:
            try:
                return self.rpc(url).get_json(path)
            except (RpcError, ConnectionError, TimeoutError, OSError):
                continue
        return None

    def close(self) -> None:
        for r in self._all:
            r.close()


# -- save ----------------------------------------------------------------------------------------


def save(cluster: Cluster, to: Path) -> dict[str, Any]:
    """Every bucket's state, each cut on its primary; returns the manifest written."""
    t0 = time.perf_counter()
    statuses = cluster.server_status()
    n_buckets = int(statuses[0]["n_buckets"])
    max_shard = int(statuses[0]["config"]["max_shard_elems"])
    defs: dict[str, dict[str, Any]] = {}
    tables: dict[str, dict[str, Any]] = {}
    shards: dict[str, dict[str, Any]] = {}
    rows: dict[str, np.ndarray] = {}
    cuts: dict[str, dict[str, Any]] = {}
    # Buckets read in parallel (a few at a time: each reply is a bucket's whole state in memory).
    with ThreadPoolExecutor(READERS) as pool:
        snaps = list(
            pool.map(
                lambda b: cluster.on_primary(b, lambda r, _n: r.call("ckpt_read", bucket=b)),
                range(n_buckets),
            )
        )
    for b, snap in enumerate(snaps):
        cuts[str(b)] = {"epoch": snap["epoch"], "seq": snap["seq"]}
        for d in snap["tensors"]:
            defs[d["name"]] = d
        for d in snap["tables"]:
            tables[d["name"]] = d
        shards.update(snap["shards"])
        for sid, rec in snap["rows"].items():
            rows[sid] = np.frombuffer(rec["b"], np.uint8)
    layout = Layout(
        [TensorSpec(n, tuple(d["shape"])) for n, d in sorted(defs.items())],
        n_buckets=n_buckets,
        max_shard_elems=max_shard,
    )
    arrays: dict[str, np.ndarray] = {}
    for name, d in defs.items():
        spec = layout.tensors[name]
        value = np.empty(spec.size, np.float32)
        accum = np.empty(spec.size, np.float32) if _has_accum(d) else None
        for s in layout.shards_of[name]:
            rec = shards.get(s.id)
            if rec is None:
                raise CheckpointError(f"no bucket answered shard {s.id}: the save is incomplete")
            value[s.start : s.stop] = np.asarray(rec["v"]).reshape(-1)
            if accum is not None and rec.get("a") is not None:
                accum[s.start : s.stop] = np.asarray(rec["a"]).reshape(-1)
        arrays[name] = value.reshape(spec.shape)
        if accum is not None:
            arrays[f"{name}/accum"] = accum.reshape(spec.shape)
    return write(
        to,
        arrays,
        rows,
        {
            "n_buckets": n_buckets,
            "max_shard_elems": max_shard,
            "tensors": [defs[n] for n in sorted(defs)],
            "tables": [tables[n] for n in sorted(tables)],
            "consistent": False,
            "cuts": cuts,
            "progress": cluster.controller_json("/progress"),
            "seconds": time.perf_counter() - t0,
        },
    )


def write(
    to: Path, arrays: dict[str, np.ndarray], rows: dict[str, np.ndarray], fields: dict[str, Any]
) -> dict[str, Any]:
    """The files of a checkpoint, each complete and synced before the manifest that lists them
    (written last, by rename): a crash mid-save leaves no manifest, never a wrong one."""
    to.mkdir(parents=True, exist_ok=True)
    (to / MANIFEST).unlink(missing_ok=True)
    listing: dict[str, dict[str, Any]] = {}
    for fname, content in ((TENSORS, arrays), (ROWS, rows)):
        tmp = to / f".{fname}.tmp"
        save_file(content, str(tmp))
        _fsynced(tmp)
        tmp.replace(to / fname)
        listing[fname] = {"bytes": (to / fname).stat().st_size, "sha256": _sha256(to / fname)}
    manifest = {"format": FORMAT, "created": time.time(), **fields, "files": listing}
    tmp = to / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1, default=_plain))
    _fsynced(tmp)
    tmp.replace(to / MANIFEST)
    return manifest


def _plain(x: Any) -> Any:
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"not JSON: {type(x).__name__}")


def _has_accum(d: dict[str, Any]) -> bool:
    return d.get("optimizer", {}).get("kind") == "adagrad"


# -- read and check --------------------------------------------------------------------------------


def load(src: Path) -> tuple[dict[str, Any], dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The manifest and arrays of a checkpoint, every file checked against the manifest
    (CheckpointError naming the file and the problem)."""
    mpath = src / MANIFEST
    if not mpath.is_file():
        raise CheckpointError(f"{mpath}: no manifest (not a checkpoint, or a save that failed)")
    try:
        manifest = json.loads(mpath.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{mpath}: not valid JSON: {exc}") from None
    fmt = manifest.get("format") if isinstance(manifest, dict) else None
    if not isinstance(fmt, int) or fmt < 1:
        raise CheckpointError(f"{mpath}: field 'format' must be a positive int, got {fmt!r}")
    if fmt > FORMAT:
        raise CheckpointError(
            f"{mpath}: format version {fmt} is newer than this adamps reads ({FORMAT}); "
            "upgrade adamps"
        )
    out: list[dict[str, np.ndarray]] = []
    for fname in (TENSORS, ROWS):
        path = src / fname
        want = manifest.get("files", {}).get(fname)
        if want is None:
            raise CheckpointError(f"{mpath}: lists no file {fname}")
        if not path.is_file():
            raise CheckpointError(f"{path}: missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(
                f"{path}: truncated or altered: {size} bytes, the manifest says {want['bytes']}"
            )
        if _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path}: checksum mismatch (sha256 differs from the manifest)")
        out.append(load_file(str(path)))
    arrays, rows = out
    for d in manifest["tensors"]:
        a = arrays.get(d["name"])
        if a is None or list(a.shape) != list(d["shape"]) or a.dtype != np.float32:
            raise CheckpointError(f"{src / TENSORS}: tensor {d['name']!r} missing or misshapen")
    return manifest, arrays, rows


# -- restore ---------------------------------------------------------------------------------------


def restore(cluster: Cluster, src: Path, force: bool = False) -> dict[str, Any]:
    """The checkpoint in `src` onto the cluster: checked whole first, then installed bucket by
    bucket on each primary (which replicates it)."""
    t0 = time.perf_counter()
    manifest, arrays, rows = load(src)
    statuses = cluster.server_status()
    n_buckets = int(statuses[0]["n_buckets"])
    max_shard = int(statuses[0]["config"]["max_shard_elems"])
    if rows and n_buckets != manifest["n_buckets"]:
        raise CheckpointError(
            f"{src / MANIFEST}: layout mismatch: the checkpoint's embedding rows are hashed "
            f"into {manifest['n_buckets']} buckets, the cluster has {n_buckets}"
        )
    held = sorted({n for s in statuses for n in s.get("tensors", {})})
    if held and not force:
        raise CheckpointError(
            f"the cluster already holds tensors {held[:5]}: restore onto an empty cluster, "
            "or pass --force to overwrite"
        )
    for s in statuses:
        for name, shape in s.get("tensors", {}).items():
            mine = next((d for d in manifest["tensors"] if d["name"] == name), None)
            if mine is not None and list(mine["shape"]) != list(shape):
                raise CheckpointError(
                    f"{src / MANIFEST}: layout mismatch: tensor {name!r} is {mine['shape']} "
                    f"in the checkpoint, {shape} on the cluster"
                )
    specs = [TensorSpec(d["name"], tuple(d["shape"])) for d in manifest["tensors"]]
    layout = Layout(specs, n_buckets=n_buckets, max_shard_elems=max_shard)
    client = PSClient(cluster.source, layout, cluster.token, retry_for=cluster.retry_for)
    try:
        for d, spec in zip(manifest["tensors"], specs, strict=True):
            client.create(spec, init={"kind": "zeros"}, optimizer=d["optimizer"])
        for t in manifest["tables"]:
            client.create_table(
                t["name"], t["dim"], init=t.get("init"), optimizer=t.get("optimizer"),
                admission=t.get("admission"),
            )  # fmt: skip
    finally:
        client.close()
    per_bucket: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for d in manifest["tensors"]:
        name = d["name"]
        flat = arrays[name].reshape(-1)
        acc = arrays.get(f"{name}/accum")
        accf = None if acc is None else acc.reshape(-1)
        for s in layout.shards_of[name]:
            rec: dict[str, Any] = {"v": np.ascontiguousarray(flat[s.start : s.stop])}
            if accf is not None:
                rec["a"] = np.ascontiguousarray(accf[s.start : s.stop])
            per_bucket.setdefault(layout.bucket_of[s.id], []).append((s.id, rec))
    row_bucket: dict[int, dict[str, Any]] = {}
    for sid, a in rows.items():
        b = int(sid.rsplit("/", 1)[1])
        row_bucket.setdefault(b, {})[sid] = {"b": a.tobytes()}

    def install_bucket(b: int) -> int:
        chunks: list[dict[str, Any]] = []
        size, cur = 0, {}
        for sid, rec in per_bucket.get(b, []):
            if cur and size + rec["v"].nbytes * 2 > INSTALL_CHUNK:
                chunks.append(cur)
                cur, size = {}, 0
            cur[sid] = rec
            size += rec["v"].nbytes * 2
        if cur:
            chunks.append(cur)
        n = 0
        # A retried install may find its own first attempt applied (the outcome of a timed-out
        # or failed-over request is unknown): a retry overwrites with the same data, so it
        # forces; a first attempt on a shard that took updates is refused by the server.
        for chunk in chunks:
            cluster.on_primary(
                b,
                lambda r, k, c=chunk: r.call(
                    "ckpt_install", bucket=b, shards=c, force=force or k > 1
                ),
            )
            n += len(chunk)
        if b in row_bucket:
            cluster.on_primary(
                b,
                lambda r, k: r.call(
                    "ckpt_install", bucket=b, rows=row_bucket[b], force=force or k > 1
                ),
            )
            n += len(row_bucket[b])
        return n

    # Buckets installed in parallel: their primaries and replication rounds are independent.
    with ThreadPoolExecutor(READERS) as pool:
        installed = sum(pool.map(install_bucket, range(n_buckets)))
    return {"installed": installed, "seconds": time.perf_counter() - t0}


# -- the command -----------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="adamps checkpoint", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_ in (("save", "save a running cluster's state"), ("restore", "restore it")):
        s = sub.add_parser(name, help=help_)
        s.add_argument("--controllers", required=True, help="comma-separated controller URLs")
        s.add_argument("--token", default=None, help="cluster token (default: $ADAMPS_TOKEN)")
        if name == "save":
            s.add_argument("--to", required=True, type=Path, help="directory to write")
        else:
            s.add_argument("--from", dest="src", required=True, type=Path, help="checkpoint dir")
            s.add_argument("--force", action="store_true", help="overwrite a non-empty cluster")
    args = p.parse_args(argv)
    cluster = Cluster([c for c in args.controllers.split(",") if c], args.token)
    try:
        if args.action == "save":
            m = save(cluster, args.to)
            print(json.dumps({"saved": str(args.to), "seconds": m["seconds"],
                              "bytes": sum(f["bytes"] for f in m["files"].values())}))  # fmt: skip
        else:
            print(json.dumps(restore(cluster, args.src, force=args.force)))
    except CheckpointError as exc:
        print(f"adamps checkpoint {args.action}: {exc}", file=sys.stderr)
        return 1
    except (RpcError, ConnectionError, TimeoutError) as exc:
        print(f"adamps checkpoint {args.action}: cluster error: {exc}", file=sys.stderr)
        return 1
    finally:
        cluster.close()
    return 0
