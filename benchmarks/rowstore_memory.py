"""Where a parameter server's memory goes for an embedding table (issue 38): one server
in-process with its real LMDB, N rows of dim D (Adagrad) pushed in batches, flushed; then the
top allocations by line (tracemalloc), RSS (anonymous and file) and LMDB bytes per row, beside
the raw bytes (values + optimizer state) per row.

    python benchmarks/rowstore_memory.py [--rows 1000000] [--dim 8] [--batch 100000] [--top 15]
        [--dtype float32|float16|bfloat16] [--optimizer adagrad|rowwise_adagrad|sgd]

Then the same server restarted in a fresh process on the same directory: its RSS per row
after the start's load (`reload_rss_bytes_per_row`).

Human-readable lines, then one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import tracemalloc
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adamps.client.rpc import AsyncRpc  # noqa: E402
from adamps.server.api.app import ParameterServer  # noqa: E402
from adamps.server.config import PsConfig  # noqa: E402
from adamps.up.procs import free_port  # noqa: E402
from adamps.wire import web as aweb  # noqa: E402

TOKEN = "rowstore-memory-token"


def rss() -> dict[str, int]:
    """RssAnon and RssFile of this process, bytes (Linux /proc)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("RssAnon", "RssFile", "VmRSS")):
            k, v = line.split(":")
            out[k] = int(v.split()[0]) * 1024
    return out


def lmdb_bytes(d: Path) -> int:
    """Bytes of the LMDB files' allocated blocks (a sparse map counts what it uses)."""
    return sum(p.stat().st_blocks * 512 for p in d.rglob("*") if p.is_file())


async def run(args: argparse.Namespace, root: Path) -> dict:
    port, dport = free_port(), free_port()
    cfg = PsConfig(port=port, data_port=dport, token=TOKEN, data_dir=str(root / "ps"),
                   owner_threads=2, flush_interval=3600, n_buckets=64)  # fmt: skip
    n, dim = args.rows, args.dim
    ids_all = np.random.default_rng(0).permutation(n).astype(np.int64) * 7919 + 13
    grads = np.full((args.batch, dim), 1e-3, np.float32)
    base = rss()
    if args.trace:
        tracemalloc.start(1)
    ps = ParameterServer(cfg)
    runner = await aweb.serve(ps.make_app(), "127.0.0.1", port)
    c = AsyncRpc(f"http://127.0.0.1:{port}", TOKEN)
    aw = {"adagrad": dim, "rowwise_adagrad": 1, "sgd": 0}[args.optimizer]
    try:
        if args.reload:
            await c.call("flush")
            now = rss()
            return {"reload_rss_bytes_per_row": (now["VmRSS"] - base["VmRSS"]) / n,
                    "reload_rss_anon_bytes_per_row": (now["RssAnon"] - base["RssAnon"]) / n}  # fmt: skip
        await c.call("create_table", name="t", dim=dim, init={"kind": "normal", "std": 0.01,
                     "seed": 1}, optimizer={"kind": args.optimizer, "lr": 0.1},
                     dtype=args.dtype)  # fmt: skip
        for s in range(0, n, args.batch):
            ids = ids_all[s : s + args.batch]
            await c.call("push_rows", table="t", ids=ids, grads=grads[: len(ids)])
            if (s // args.batch) % 5 == 4:
                await c.call("flush")
        await c.call("flush")
        snap = tracemalloc.take_snapshot() if args.trace else None
        now = rss()
        raw = dim * (4 if args.dtype == "float32" else 2) + aw * 4
        out = {
            "rows": n, "dim": dim, "raw_bytes_per_row": raw,
            "rss_bytes_per_row": (now["VmRSS"] - base["VmRSS"]) / n,
            "rss_anon_bytes_per_row": (now["RssAnon"] - base["RssAnon"]) / n,
            "rss_file_bytes_per_row": (now["RssFile"] - base["RssFile"]) / n,
            "lmdb_bytes_per_row": lmdb_bytes(root / "ps") / n,
            "store_bytes_per_row": (await c.call("list_tables"))["tables"][0]["bytes_held"] / n,
        }  # fmt: skip
        out["rss_bytes_per_row_over_raw"] = out["rss_bytes_per_row"] / raw
        out["lmdb_bytes_per_row_over_raw"] = out["lmdb_bytes_per_row"] / raw
        if snap is not None:
            traced = sum(s.size for s in snap.statistics("filename"))
            out["traced_bytes_per_row"] = traced / n
            print(f"tracemalloc: {traced / n:.1f} bytes per row in all; top lines:")
            for st in snap.statistics("lineno")[: args.top]:
                fr = st.traceback[0]
                name = (
                    os.path.relpath(fr.filename, ROOT) if str(ROOT) in fr.filename else fr.filename
                )
                print(f"  {st.size / n:8.1f} B/row  {st.count:>8} blocks  {name}:{fr.lineno}")
        return out
    finally:
        await c.close()
        await runner.cleanup()
        ps.close() if hasattr(ps, "close") else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=8)
    ap.add_argument("--batch", type=int, default=100_000)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--optimizer", default="adagrad", choices=["adagrad", "rowwise_adagrad", "sgd"])
    ap.add_argument("--no-trace", dest="trace", action="store_false",
                    help="RSS without tracemalloc's own overhead")  # fmt: skip
    ap.add_argument("--reload", help=argparse.SUPPRESS)  # the restarted server's directory
    args = ap.parse_args()
    if args.reload:
        args.trace = False
        print(json.dumps(asyncio.run(run(args, Path(args.reload)))))
        return 0
    with tempfile.TemporaryDirectory(prefix="adamps-rowmem-") as d:
        out = asyncio.run(run(args, Path(d)))
        again = subprocess.run(
            [sys.executable, __file__, "--rows", str(args.rows), "--dim", str(args.dim),
             "--dtype", args.dtype, "--optimizer", args.optimizer, "--reload", d],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        out.update(json.loads(again.stdout.strip().splitlines()[-1]))
    for k, v in out.items():
        print(f"{k}: {v:,.1f}" if isinstance(v, float) else f"{k}: {v}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
