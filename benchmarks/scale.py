"""Memory, disk and flush time against the model's size on one server (issue 30).

For models of 64 MiB, 256 MiB and 1 GiB of values on one standalone `adamps ps` (Adagrad, so the
server's state is values + accumulators = 2x the values; flush_interval 1 s, LMDB on the disk
of the temporary directory; max_unflushed 120 s, see below), one `PSClient` pushes full-model dense deltas (`push_dense_many`)
in a loop. Printed per size:

- RSS under that load (the peak of /proc/PID/status VmRSS, sampled every 0.1 s) divided by the
  bytes of the state; goal <= 1.5x state + 256 MiB. Also the peak of RssAnon, the memory the
  server needs: VmRSS also counts the clean page cache of data.mdb that LMDB's read-only map has
  touched (reading or replacing a record maps its pages), which is shared with the kernel's cache
  and dropped under memory pressure; the goal is judged on both;
- LMDB bytes on disk (blocks of data.mdb) divided by the state; goal <= 1.5;
- flush seconds per GB written (from the server's adamps_ps_flush_seconds and
  adamps_ps_flushed_bytes) against the disk's sequential write bandwidth, measured in the same
  run (8 MiB writes then fsync, in the same directory); goal >= 0.5 of it;
- push GB/s; goal at 1 GiB >= 0.8 of that at 64 MiB.

Run: python benchmarks/scale.py [--sizes 64,256,1024] [--seconds 12]   (the last line is one JSON
object; about 2 minutes at the default sizes)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np

from adamps.client import PSClient, StaticRouting
from adamps.layout import Layout, TensorSpec
from adamps.up.procs import Proc, adamps_argv, free_port

MiB = 1 << 20
TENSOR_BYTES = 64 * MiB
TOKEN = "bench-token"
N_BUCKETS = 64


def disk_write_bandwidth(directory: Path, total: int = 512 * MiB, chunk: int = 8 * MiB) -> float:
    """Sequential write bandwidth of `directory`'s filesystem in GB/s: `total` bytes in `chunk`
    writes, then fsync (what a flush's commit must wait for)."""
    buf = np.random.default_rng(0).integers(0, 255, chunk, dtype=np.uint8).tobytes()
    path = directory / "bandwidth.probe"
    t0 = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for _ in range(total // chunk):
            f.write(buf)
        os.fsync(f.fileno())
    seconds = time.perf_counter() - t0
    path.unlink()
    return total / seconds / 1e9


def rss_bytes(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def metric(base: str, name: str) -> float:
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(rf"^{re.escape(name)} ([0-9.eE+-]+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


class Sampler(threading.Thread):
    """Peak RSS (and peak RssAnon) of a process, sampled every 0.1 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak, self.peak_anon, self._stop_ = pid, 0, 0, threading.Event()

    def run(self) -> None:
        while not self._stop_.wait(0.1):
            self.peak = max(self.peak, rss_bytes(self.pid))
            self.peak_anon = max(self.peak_anon, rss_bytes(self.pid, "RssAnon"))

    def stop(self) -> int:
        self._stop_.set()
        self.join()
        return self.peak


def one_size(size_mib: int, seconds: float, disk_gbps: float, tmp: Path) -> dict[str, float]:
    n_tensors = max(1, size_mib * MiB // TENSOR_BYTES)
    elems = TENSOR_BYTES // 4
    values = n_tensors * TENSOR_BYTES
    state = 2 * values  # values + Adagrad accumulators
    data_dir = tmp / f"ps-{size_mib}"
    port, data_port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    proc = Proc(
        adamps_argv(
            "ps",
            "--port", str(port), "--data-port", str(data_port), "--data-dir", str(data_dir),
            "--n-buckets", str(N_BUCKETS), "--flush-interval", "1",
            # A flush of the whole state takes state / disk bandwidth (17 s for 2 GiB at
            # 0.12 GB/s): the default max_unflushed (5 s) would refuse pushes (not_durable)
            # while it runs, as it must (docs/operations.md, "Memory and disk per GB of model").
            "--max-unflushed", "120",
            "--max-server-elems", str(max(1 << 28, 2 * n_tensors * elems)),
        ),
        tmp / f"ps-{size_mib}.log",
        env={**os.environ, "ADAMPS_TOKEN": TOKEN},
        name=f"ps-{size_mib}",
    )  # fmt: skip
    try:
        proc.wait_http(base + "/healthz", 60.0)
        specs = [TensorSpec(f"t{i}", (elems,)) for i in range(n_tensors)]
        client = PSClient(StaticRouting([base], N_BUCKETS), Layout(specs, N_BUCKETS), TOKEN)
        for spec in specs:
            client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "adagrad", "lr": 0.01})
        rss_created = rss_bytes(proc.pid)
        deltas = {s.name: np.full(elems, 1e-3, np.float32) for s in specs}
        client.push_dense_many(deltas)  # warm the connections and buffers
        sampler = Sampler(proc.pid)
        sampler.start()
        flush0 = metric(base, "adamps_ps_flush_seconds_sum")
        flushed0 = metric(base, "adamps_ps_flushed_bytes_total")
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            client.push_dense_many(deltas)
            n += 1
        push_seconds = time.perf_counter() - t0
        time.sleep(2.5)  # the flushes of the last pushes
        peak = sampler.stop()
        anon = sampler.peak_anon
        flush_s = metric(base, "adamps_ps_flush_seconds_sum") - flush0
        flushed = metric(base, "adamps_ps_flushed_bytes_total") - flushed0
        client.close()
        mdb = data_dir / "data.mdb"
        lmdb_bytes = mdb.stat().st_blocks * 512 if mdb.exists() else 0
    finally:
        proc.stop()
    flush_gbps = flushed / flush_s / 1e9 if flush_s > 0 else 0.0
    out = {
        "state_MiB": state / MiB,
        "rss_created_MiB": rss_created / MiB,
        "rss_peak_MiB": peak / MiB,
        "rss_over_state": peak / state,
        "rss_goal_MiB": (1.5 * state + 256 * MiB) / MiB,
        "anon_peak_MiB": anon / MiB,
        "anon_over_state": anon / state,
        "lmdb_MiB": lmdb_bytes / MiB,
        "lmdb_over_state": lmdb_bytes / state,
        "flush_GBps": flush_gbps,
        "flush_over_disk": flush_gbps / disk_gbps,
        "push_GBps": n * values / push_seconds / 1e9,
    }
    print(
        f"  {size_mib:5d} MiB values ({state / MiB:6.0f} MiB state): "
        f"RSS {peak / MiB:7.0f} MiB = {peak / state:4.2f}x state "
        f"(goal <= {out['rss_goal_MiB']:.0f} MiB: {'met' if peak <= 1.5 * state + 256 * MiB else 'MISSED'}), "
        f"anon {anon / MiB:7.0f} MiB = {anon / state:4.2f}x ({'met' if anon <= 1.5 * state + 256 * MiB else 'MISSED'}); "
        f"LMDB {lmdb_bytes / state:4.2f}x state (goal <= 1.5: {'met' if lmdb_bytes <= 1.5 * state else 'MISSED'}); "
        f"flush {flush_gbps:5.2f} GB/s = {out['flush_over_disk']:4.2f} of the disk "
        f"(goal >= 0.5: {'met' if out['flush_over_disk'] >= 0.5 else 'MISSED'}); "
        f"push {out['push_GBps']:5.2f} GB/s",
        flush=True,
    )
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--sizes", default="64,256,1024", help="MiB of values per server, comma-separated"
    )
    p.add_argument("--seconds", type=float, default=12.0, help="push load per size")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"adamps benchmarks/scale.py ({os.cpu_count()} CPUs, Python {sys.version.split()[0]})")
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("ADAMPS_BENCH_DIR")) as d:
        tmp = Path(d)
        disk = disk_write_bandwidth(tmp)
        print(
            f"limit: the disk's sequential write bandwidth (8 MiB writes + fsync): {disk:.2f} GB/s"
        )
        results["disk_write_GBps"] = round(disk, 3)
        for size in sizes:
            for k, v in one_size(size, args.seconds, disk, tmp).items():
                results[f"{k}_{size}MiB"] = round(v, 3)
    first, last = sizes[0], sizes[-1]
    ratio = results[f"push_GBps_{last}MiB"] / results[f"push_GBps_{first}MiB"]
    results[f"push_{last}MiB_over_{first}MiB"] = round(ratio, 3)
    print(
        f"push GB/s at {last} MiB / at {first} MiB: {ratio:.2f} "
        f"(goal >= 0.8: {'met' if ratio >= 0.8 else 'MISSED'})"
    )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
