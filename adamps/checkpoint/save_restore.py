"""``adamps checkpoint save|restore``: a model's state out of one running cluster and into
another of any size (issue 24).

The format (adamps/checkpoint/format.py, docs/operations.md shows how to read it without adamps): a
``manifest.json`` naming, per bucket, the cut ``{epoch, seq}`` its state was read at (``seq``
is the bucket's committed replication position on its primary; ``consistent``: false, each
bucket is cut on its own, not at one instant across buckets) and, per shard, the
``bucket-NNNN.safetensors`` file that holds its values, Adagrad accumulator or row block. An
incremental save (``base``) writes only what changed since an earlier checkpoint.

The manifest is written last, after every file is complete and synced: a directory without
one is not a checkpoint. ``restore`` checks everything (format version, every file's size and
checksum, the layout against the target cluster, the target's emptiness) before its first
write; its writes go through the servers' one write path (``ckpt_install``; adamps/checkpoint/restore.py)."""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from adamps import clusters
from adamps.checkpoint.cluster import WAIT, Cluster
from adamps.checkpoint.format import (  # noqa: F401 (re-exported: the format's names live there)
    FORMAT,
    MANIFEST,
    CheckpointError,
    bucket_file,
    load,
    read_manifest,
    write,
    write_file,
    write_manifest,
)
from adamps.checkpoint.restore import install, restore  # noqa: F401 (re-exported)
from adamps.client.rpc import RpcError
from adamps.layout import Layout, TensorSpec
from adamps.security import tls

#: buckets read at once by a save
READERS = 4
#: seconds a consistent cut's write hold lasts at most (it is released as soon as every
#: server marked its buckets; the expiry is for a save tool that dies meanwhile)
HOLD_SECONDS = 5.0
#: attempts at a consistent cut before the save fails (at least; more within WAIT)
CUT_ATTEMPTS = 3
#: the files a save writes before its manifest: what a failed save's directory may hold
_SAVE_FILE_RE = re.compile(r"\.?bucket-\d{4,}\.safetensors(\.tmp)?|\.manifest\.json\.tmp")


# -- save ----------------------------------------------------------------------------------------


def _claim(to: Path) -> None:
    """Makes `to` the new checkpoint's directory: new, empty, or a failed save's (no manifest,
    only the data files a save writes).
    A complete checkpoint there is refused, never overwritten: a mistyped --to would otherwise
    replace an older backup (and a save that then failed left neither)."""
    if (to / MANIFEST).exists():
        raise CheckpointError(
            f"{to} holds a checkpoint ({MANIFEST}); save into a new directory (a checkpoint is "
            "never overwritten)"
        )
    if to.exists() and not to.is_dir():
        raise CheckpointError(f"{to} is a file, not a directory")
    # Anything else in a non-empty directory is someone's data: a save would mix its files in
    # (and a later series prune could delete them).
    try:
        foreign = sorted(p.name for p in to.iterdir() if not _SAVE_FILE_RE.fullmatch(p.name))
    except FileNotFoundError:
        foreign = []
    except OSError as exc:
        raise CheckpointError(f"cannot read {to}: {exc.strerror or exc}") from None
    if foreign:
        raise CheckpointError(
            f"{to} is not empty and not a checkpoint (it holds {foreign[:3]}"
            f"{' ...' if len(foreign) > 3 else ''}): save into a new or empty directory"
        )
    try:
        to.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {to}: {exc.strerror or exc}") from None


def save(
    cluster: Cluster,
    to: Path,
    base: Path | None = None,
    consistent: bool = False,
    hold_seconds: float = HOLD_SECONDS,
) -> dict[str, Any]:
    """Every bucket's state, each cut on its primary, into `to`; returns the manifest written
    (``_save``). A save that fails (an error, no cluster, Ctrl-C) removes the directory it
    made: it left an empty or partial directory behind, which a later `--to` of the same path
    had to take over. One killed outright leaves it without a manifest (refused by restore,
    taken again by the next save)."""
    made = not to.exists()
    try:
        return _save(cluster, to, base, consistent, hold_seconds)
    except BaseException:
        if made:
            shutil.rmtree(to, ignore_errors=True)
        raise


def _save(
    cluster: Cluster,
    to: Path,
    base: Path | None,
    consistent: bool,
    hold_seconds: float,
) -> dict[str, Any]:
    """Every bucket's state, each cut on its primary, into `to`; returns the manifest written.

    With `base` (an earlier checkpoint in the same parent directory) the save is incremental:
    a shard unchanged since `base` (same version) is not written again, and the manifest names
    the file of `base` that holds it. With `consistent`, every bucket is cut at one instant:
    every server holds new writes while it marks its buckets (``ckpt_hold``), and the
    manifest records how long the writes were held (``hold_ms``)."""
    t0 = time.perf_counter()
    _claim(to)  # before any request: a refused --to is refused whatever the cluster's state
    statuses = cluster.server_status()
    if not statuses:
        raise CheckpointError("the cluster has no parameter server to read from")
    n_buckets = int(statuses[0]["n_buckets"])
    max_shard = int(statuses[0]["config"]["max_shard_elems"])
    view = cluster.controller_json("/cluster") or {}
    declared_lost = view.get("declared_lost")
    prev = _base_of(to, base, n_buckets, declared_lost)

    def since(b: int) -> dict[str, Any]:
        if prev is None or str(b) not in prev["cuts"]:
            return {}
        versions = {sid: r["version"] for part in ("shards", "row_shards")
                    for sid, r in prev[part].items() if r.get("bucket") == b}  # fmt: skip
        return {"versions": versions}

    held = None
    until = time.monotonic() + cluster.retry_for
    for attempt in itertools.count(1) if consistent else ():
        # A cut that met a failover (a bucket without a primary, a crashed server not declared
        # dead yet) is taken again, at least CUT_ATTEMPTS times and until the deadline.
        try:
            held = _hold_all(cluster, n_buckets, hold_seconds)
            break
        except CheckpointError as exc:
            if attempt >= CUT_ATTEMPTS and time.monotonic() + 1.0 > until:
                raise CheckpointError(
                    f"{exc} (still after {attempt} attempts in {cluster.retry_for:g} s, --wait)"
                ) from None
            time.sleep(1.0)

    def read_bucket(b: int) -> tuple[dict[str, Any], dict[str, Any] | None]:
        # Each bucket's changed shards go to disk as soon as they are read: a save holds a few
        # buckets in memory, never the whole model.
        if held is None:
            # over the data plane: the bucket's arrays arrive as the reply's raw payload,
            # received into one buffer and written to the file from it (issue 38 item 7)
            snap = cluster.on_primary(
                b, lambda r, _n: cluster.message(r, "ckpt_read", bucket=b, since=since(b))
            )
        else:
            snap = _read_cut(cluster, held, b)
            known = since(b).get("versions", {})
            for part in ("shards", "rows"):
                for sid in [k for k, r in snap[part].items() if known.get(k) == r["version"]]:
                    snap["unchanged"][sid] = snap[part].pop(sid)["version"]
        content: dict[str, np.ndarray] = {}
        for sid, rec in snap["shards"].items():
            content[sid] = np.asarray(rec["v"], np.float32).reshape(-1)
            if rec.get("a") is not None:
                content[f"{sid}/accum"] = np.asarray(rec["a"], np.float32).reshape(-1)
        for sid, rec in snap["rows"].items():
            content[sid] = np.frombuffer(rec["b"], np.uint8)
        entry = write_file(to / bucket_file(b), content) if content else None
        return snap, entry

    try:
        with ThreadPoolExecutor(READERS) as pool:
            results = list(pool.map(read_bucket, range(n_buckets)))
    except BaseException:
        if held is not None:  # the servers' copies of the cut are of no use now
            for url in {u for u, _p in held["where"].values()}:
                _release(cluster, url, held["cut"], drop=True)
        raise
    defs: dict[str, dict[str, Any]] = {}
    tables: dict[str, dict[str, Any]] = {}
    cuts: dict[str, dict[str, Any]] = {}
    files: dict[str, dict[str, Any]] = {}
    shards: dict[str, dict[str, Any]] = {}
    row_shards: dict[str, dict[str, Any]] = {}
    written = 0
    for b, (snap, entry) in enumerate(results):
        cuts[str(b)] = {"epoch": snap["epoch"], "seq": snap["seq"]}
        for d in snap["tensors"]:
            defs[d["name"]] = d
        for d in snap["tables"]:
            tables[d["name"]] = d
        if entry is not None:
            files[bucket_file(b)] = entry
            written += entry["bytes"]
        here = {"file": bucket_file(b), "bucket": b, "epoch": snap["epoch"]}
        for sid, rec in snap["shards"].items():
            shards[sid] = {**here, "version": rec["version"], "accum": rec.get("a") is not None}
        for sid, rec in snap["rows"].items():
            row_shards[sid] = {**here, "version": rec["version"]}
        for sid in snap.get("unchanged", {}):
            part = "shards" if prev is not None and sid in prev["shards"] else "row_shards"
            old = prev[part][sid] if prev is not None else None
            if old is None:
                raise CheckpointError(f"bucket {b}: shard {sid} unchanged since a checkpoint "
                                      "that does not hold it")  # fmt: skip
            rel = _relative(old["file"], base)
            (shards if part == "shards" else row_shards)[sid] = {**old, "file": rel}
            files[rel] = prev["files"][old["file"]]
    layout = Layout(
        [TensorSpec(n, tuple(d["shape"])) for n, d in sorted(defs.items())],
        n_buckets=n_buckets,
        max_shard_elems=max_shard,
    )
    for name in defs:
        for s in layout.shards_of[name]:
            if s.id not in shards:
                b = layout.bucket_of[s.id]
                if all(d["name"] != name for d in results[b][0]["tensors"]):
                    # A create that reached some servers only (create is not replicated): every
                    # save fails until it is sent again, so say that, not "incomplete".
                    raise CheckpointError(
                        f"tensor {name!r} is defined on some servers only: bucket {b}'s "
                        f"primary does not hold it (a create that did not reach every server); "
                        "send its create again to every server (docs/protocol-ps.md, create), "
                        "then save"
                    )
                raise CheckpointError(f"no bucket answered shard {s.id}: the save is incomplete")
            shards[s.id].update(tensor=name, start=s.start, stop=s.stop)
    return write_manifest(
        to,
        {
            "n_buckets": n_buckets,
            "max_shard_elems": max_shard,
            "tensors": [defs[n] for n in sorted(defs)],
            "tables": [tables[n] for n in sorted(tables)],
            "consistent": held is not None,
            **(
                {}
                if held is None
                else {
                    "hold_ms": held["hold_ms"],
                    "hold_server_ms": held["server_ms"],
                    "cut": held["cut"],
                    "cut_on": {str(b): url for b, (url, _p) in sorted(held["where"].items())},
                }
            ),  # fmt: skip
            "cuts": cuts,
            "progress": cluster.controller_json("/progress"),
            "base": None if prev is None else base.name,
            "declared_lost": declared_lost,
            "written_bytes": written,
            "shards": shards,
            "row_shards": row_shards,
            "files": files,
            "seconds": time.perf_counter() - t0,
        },
    )


def _hold_all(cluster: Cluster, n_buckets: int, seconds: float) -> dict[str, Any]:
    """One cut of every bucket: every server holds writes and marks the shards of the buckets
    it is primary of for the cut (in parallel; copied on write, adamps/server/store/cut_copies.py),
    then every hold is released. Returns the cut's id, where each bucket's
    copy is (server URL, [epoch, seq]) and how long writes were held, as this side saw it
    (from the first hold sent to the last release answered: the longest stall a push saw)."""
    cut = uuid.uuid4().hex
    # A crashed server is left out: its buckets are then missing from the cut (tried again)
    servers = [url for url, _rpc in cluster.live_servers()]
    # One thread per server for the whole cut, its connection opened before the first hold:
    # the hold then lasts two round trips per server. With a thread pool for the holds and
    # another for the releases, each starting threads and opening connections inside the
    # hold, the stall was 80-110 ms at load 30 of which the servers' drain and marking took
    # 7-18 (benchmarks/checkpoint.py, issue 38 item 7).
    n = len(servers)
    if not n:
        raise CheckpointError("consistent cut: no server answers")
    opened = threading.Barrier(n + 1)
    answered = threading.Barrier(n)
    replies: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def cut_on(i: int, url: str) -> None:
        rpc = cluster.rpc(url)
        try:
            rpc.get_json("/healthz")  # opens this thread's connection
        except (RpcError, ConnectionError, TimeoutError, OSError):
            pass  # the hold says why
        try:
            opened.wait(WAIT)
            replies[i] = rpc.call("ckpt_hold", cut=cut, seconds=seconds)
        except (RpcError, ConnectionError, TimeoutError, OSError) as exc:
            errors[i] = exc
        except threading.BrokenBarrierError:
            errors[i] = TimeoutError("the other servers' holds did not start")
        finally:
            try:  # released once every hold is answered (or failed)
                answered.wait(seconds + WAIT)
            except threading.BrokenBarrierError:
                pass
            _release(cluster, url, cut)

    threads = [threading.Thread(target=cut_on, args=(i, u), daemon=True)
               for i, u in enumerate(servers)]  # fmt: skip
    for th in threads:
        th.start()
    try:
        opened.wait(WAIT)
    except threading.BrokenBarrierError:
        pass  # a thread failed: each releases its hold, the error is raised below
    t0 = time.perf_counter()
    for th in threads:
        th.join()
    failed = next((e for e in errors if e is not None), None)
    if failed is not None:
        raise CheckpointError(f"consistent cut: a server could not hold writes: {failed}")
    hold_ms = (time.perf_counter() - t0) * 1e3
    where: dict[int, tuple[str, list[int]]] = {}
    for url, rep in zip(servers, replies, strict=True):
        for b, pos in rep["positions"].items():
            if int(b) in where:
                raise CheckpointError(f"consistent cut: two servers cut bucket {b}; try again")
            where[int(b)] = (url, pos)
    missing = sorted(set(range(n_buckets)) - set(where))
    if missing:
        for url in servers:
            _release(cluster, url, cut, drop=True)
        raise CheckpointError(
            f"consistent cut: buckets {missing[:10]} had no primary at the cut (a failover "
            "under way); try again"
        )
    return {"cut": cut, "where": where, "hold_ms": hold_ms,
            "server_ms": max((r["drain_ms"] + r["copy_ms"] for r in replies), default=0.0)}  # fmt: skip


def _release(cluster: Cluster, url: str, cut: str, drop: bool = False) -> None:
    # Best effort: a hold that is not released ends by itself at its expiry.
    try:
        cluster.rpc(url).call("ckpt_release", cut=cut, drop=drop)
    except (RpcError, ConnectionError, TimeoutError, OSError):
        pass


def _read_cut(cluster: Cluster, held: dict[str, Any], b: int) -> dict[str, Any]:
    """Bucket b's copy of the cut, from the server that took it, checked against the
    position that server reported at the cut."""
    url, pos = held["where"][b]
    try:
        snap = cluster.message(cluster.rpc(url), "ckpt_read", bucket=b, cut=held["cut"])
    except (RpcError, ConnectionError, TimeoutError, OSError) as exc:
        raise CheckpointError(f"consistent cut: bucket {b}'s copy on {url}: {exc}") from None
    if [snap["epoch"], snap["seq"]] != list(pos):
        raise CheckpointError(f"consistent cut: bucket {b} read at {snap['epoch']}/{snap['seq']}, "
                              f"cut at {pos[0]}/{pos[1]}")  # fmt: skip
    snap.setdefault("unchanged", {})
    return snap


def _base_of(
    to: Path, base: Path | None, n_buckets: int, declared_lost: int | None
) -> dict[str, Any] | None:
    """The manifest of an incremental save's base, or None for a full save (no base, or one
    an incremental save cannot build on: another directory, format or bucket count, or a
    bucket declared lost since, whose re-created shards count their versions afresh)."""
    if base is None:
        return None
    if base.resolve().parent != to.resolve().parent:
        raise CheckpointError(f"{base}: an incremental base must be a sibling of {to}")
    try:
        prev = read_manifest(base)
    except CheckpointError:
        return None
    if prev["format"] < 2 or prev.get("n_buckets") != n_buckets:
        return None
    if declared_lost is None or prev.get("declared_lost") != declared_lost:
        return None
    return prev


def _relative(name: str, base: Path | None) -> str:
    """A file name of `base`'s manifest as seen from a sibling checkpoint."""
    assert base is not None
    return name if name.startswith("../") else f"../{base.name}/{name}"


# -- the command -----------------------------------------------------------------------------------


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not 0 < v <= 3600:
        raise argparse.ArgumentTypeError(f"must be seconds in (0, 3600], got {text!r}")
    return v


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="adamps checkpoint", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_ in (("save", "save a running cluster's state"), ("restore", "restore it")):
        s = sub.add_parser(name, help=help_)
        clusters.add_arguments(s)
        s.add_argument(
            "--wait",
            type=_seconds,
            default=WAIT,
            help=f"seconds to wait for a bucket's primary (a failover under way) before the "
            f"command fails (default {WAIT:g})",
        )
        tls.add_arguments(s)
        if name == "save":
            s.add_argument("--to", required=True, type=Path, help="directory to write")
            s.add_argument(
                "--consistent",
                action="store_true",
                help="one cut across all buckets: writes are held (503 held, retried by "
                "clients) while every server copies its buckets",
            )
        else:
            s.add_argument("--from", dest="src", required=True, type=Path, help="checkpoint dir")
            s.add_argument(
                "--force",
                action="store_true",
                help="restore onto a cluster that holds tensors: the checkpoint's overwrite those of "
                "the same names; the others stay",
            )
    args = p.parse_args(argv)
    try:
        tls.install_from(args)  # a cluster with TLS on (docs/operations.md, "Security")
        who = f"adamps checkpoint {args.action}"
        target = clusters.resolve(args.controllers, args.token, args.cluster, who)
    except ValueError as exc:  # TLS files, no such cluster, no token
        print(f"adamps checkpoint {args.action}: {exc}", file=sys.stderr)
        return 2
    cluster = Cluster(target.controllers, target.token, args.wait)
    try:
        if args.action == "save":
            m = save(cluster, args.to, consistent=args.consistent)
            print(json.dumps({"saved": str(args.to), "seconds": m["seconds"],
                              "bytes": sum(f["bytes"] for f in m["files"].values()),
                              "consistent": m["consistent"], "hold_ms": m.get("hold_ms")}))  # fmt: skip
        else:
            print(json.dumps(restore(cluster, args.src, force=args.force)))
    except CheckpointError as exc:
        print(f"adamps checkpoint {args.action}: {exc}", file=sys.stderr)
        return 1
    except (RpcError, ConnectionError, TimeoutError) as exc:
        msg = clusters.explain(exc, target)
        print(f"adamps checkpoint {args.action}: cluster error: {msg}", file=sys.stderr)
        return 1
    finally:
        cluster.close()
    return 0
