"""What an idle cluster costs: CPU seconds per second of every process of a local cluster that
serves nothing.

Starts the cluster `adamps up` starts (3 controllers, 3 parameter servers, RF 3, 64 buckets, the
default configuration, and a data server unless `--no-dataserver`) as real processes, creates one
tensor of `--state-mb` MB with Adagrad and pushes to it once (a model the cluster holds, so the
scrub has records to verify; 0: an empty cluster), waits until every bucket is placed and
`--settle` seconds more (joins, the tensor's first flush, elections done), then reads utime +
stime of every process of the cluster, children included, from /proc/PID/stat at the start and
at the end of `--seconds` seconds, and the voluntary context switches of all their threads: how
often they were woken. A timer that ticks for nothing shows there even on a loaded machine, which
hides it in CPU time (a 20 ms sleep lasts longer there, so fewer ticks run). Prints each process's
CPU seconds and wakeups per second, the machine's load average, and last one JSON object with
`idle_cluster_cpu_s_per_s`.

    python benchmarks/idle.py [--seconds 30] [--settle 10] [--state-mb 16] [--no-dataserver]
        [--rows N --dim 16] [--keep-open] [--threads]
    python benchmarks/idle.py --scrub-cost 512

`--scrub-cost MB` measures instead what the background scrub costs: it writes MB of shard records
(values and Adagrad accumulators, 1 MiB each) to a fresh LMDB environment, verifies them twice as
the scrub does (``Persister.scan`` in 4 MiB steps) and prints the scrub thread's CPU seconds per
GiB and how long a pass takes per GiB at the default bounds (docs/operations.md quotes it).

`--rows N` also loads an embedding table of N rows (`--dim`, Adagrad, `push_rows` in pushes of
100,000) before it settles: the idle cost of a cluster holding rows, with the default settings
(the scrub at its default bounds; benchmarks/embeddings.py's idle figure comes from its cluster
with fast timers: heartbeats and pings every 0.2 s and no scrub).

`--threads` also prints each thread's CPU seconds and wakeups per second, named as the process's
`/status` names them (its Python thread names: the event loop is MainThread, a controller's Raft
thread pysyncobj's `_autoTickThread`): where an idle cluster's CPU goes.

`--keep-open` leaves the cluster running after the measurement and prints its pids, so that
`py-spy record --pid PID --idle` can profile one member (Ctrl-C stops it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import LocalCluster, http_json

#: clock ticks per second of /proc/PID/stat's utime and stime
CLK_TCK = os.sysconf("SC_CLK_TCK")


def _children() -> dict[int, list[int]]:
    """ppid -> pids of every process on the machine (Linux /proc)."""
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out.setdefault(ppid, []).append(int(d.name))
    return out


def tree(pid: int) -> list[int]:
    """`pid` and every process below it."""
    kids = _children()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, ()))
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` plus what its waited-for children used (cutime + cstime)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return 0.0
    return sum(int(x) for x in f[11:15]) / CLK_TCK


def wakeups(pid: int) -> int:
    """Voluntary context switches of every thread of `pid`: how often its threads slept and
    were woken (a timer, a message). Unlike CPU time, a loaded machine barely changes it."""
    n = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0
    for t in tasks:
        try:
            for line in (t / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    n += int(line.split()[1])
        except OSError:
            continue
    return n


def thread_stats(pid: int) -> dict[int, tuple[float, int]]:
    """tid -> (CPU seconds, voluntary context switches) of every thread of `pid`."""
    out: dict[int, tuple[float, int]] = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            f = (t / "stat").read_text().rsplit(")", 1)[1].split()
            vol = next(
                int(line.split()[1])
                for line in (t / "status").read_text().splitlines()
                if line.startswith("voluntary_ctxt_switches:")
            )
        except (OSError, StopIteration, IndexError, ValueError):
            continue
        out[int(t.name)] = ((int(f[11]) + int(f[12])) / CLK_TCK, vol)
    return out


def thread_names(c: LocalCluster) -> dict[str, dict[int, str]]:
    """member -> {tid: Python thread name}, from each member's /status (`threads`)."""
    addr = {f"controller{i}": a for i, a in enumerate(c.controllers)}
    addr.update(zip(c.server_ids, c.servers, strict=True))
    out: dict[str, dict[int, str]] = {}
    for n, a in addr.items():
        try:
            code, st = http_json(f"http://{a}/status", timeout=5.0)
        except Exception:  # noqa: BLE001 - a name is a label only
            continue
        if code == 200 and isinstance(st, dict):
            out[n] = {int(k): str(v) for k, v in (st.get("threads") or {}).items()}
    return out


def per_thread(
    c: LocalCluster,
    before: dict[str, dict[int, tuple[float, int]]],
    after: dict[str, dict[int, tuple[float, int]]],
    dt: float,
) -> dict[str, dict[str, list[float]]]:
    """member -> thread name -> [CPU-s per s, wakeups per s] (threads of one name summed)."""
    names = thread_names(c)
    out: dict[str, dict[str, list[float]]] = {}
    for n, threads in after.items():
        mine = out.setdefault(n, {})
        for tid, (cpu, vol) in threads.items():
            c0, v0 = before.get(n, {}).get(tid, (0.0, 0))
            name = names.get(n, {}).get(tid, "MainThread" if tid == c.procs[n].pid else str(tid))
            got = mine.setdefault(name, [0.0, 0.0])
            got[0] += (cpu - c0) / dt
            got[1] += (vol - v0) / dt
    return {
        n: {
            k: [round(v[0], 4), round(v[1], 1)]
            for k, v in sorted(t.items(), key=lambda x: -x[1][0])
        }
        for n, t in out.items()
    }


def sample(cluster: LocalCluster) -> dict[str, dict[int, tuple[float, int]]]:
    """member name -> {pid: (CPU seconds, wakeups)} for every process of each member's tree."""
    return {
        n: {p: (cpu_seconds(p), wakeups(p)) for p in tree(proc.pid)}
        for n, proc in cluster.procs.items()
    }


def used(
    before: dict[int, tuple[float, int]], after: dict[int, tuple[float, int]]
) -> tuple[float, int]:
    """CPU seconds and wakeups of a member's processes between two samples (a process born
    meanwhile counts whole; one that ended meanwhile is in its parent's cutime if it was waited
    for)."""
    cpu = sum(c - before.get(p, (0.0, 0))[0] for p, (c, _w) in after.items())
    return cpu, sum(w - before.get(p, (0.0, 0))[1] for p, (_c, w) in after.items())


def scrub_cost(mb: float) -> dict[str, float]:
    """CPU seconds per GiB of the scrub's verification of shard records, and a pass's seconds
    per GiB at the default scrub_rate and scrub_cpu (the longer bound wins)."""
    from adamps.server.config import PsConfig
    from adamps.server.storage.persist import Persister

    n = max(1, int(mb // 2))
    p = Persister(tempfile.mkdtemp(prefix="adamps-scrub-"), map_size=4 * n << 20)
    value = np.ones(262_144, np.float32)
    meta = {"spec": {"name": "w", "shape": [n * 262_144]}, "optimizer": {"kind": "adagrad"}}
    p.write_tensor({**meta, "seq": 0}, [(f"w/{i}", 1, value, value) for i in range(n)])
    best = float("inf")
    for _ in range(2):
        after, total, c0 = None, 0, time.thread_time()
        while True:
            _failures, after, nbytes = p.scan(after, 4 << 20)
            total += nbytes
            if after is None:
                break
        best = min(best, (time.thread_time() - c0) / (total / 2**30))
    p.close()
    cfg = {f.name: f.default for f in dataclasses.fields(PsConfig)}  # the defaults, no token
    cpu, rate = cfg["scrub_cpu"], cfg["scrub_rate"]
    by_cpu, by_rate = best / cpu, 2**30 / rate
    print(f"scrub: {total / 2**20:.0f} MiB of shard records, {best:.3f} CPU-s per GiB verified")
    print(f"  a pass per GiB: {by_cpu:.0f} s at scrub_cpu {cpu}, {by_rate:.0f} s at "
          f"scrub_rate {rate >> 20} MiB/s: {max(by_cpu, by_rate):.0f} s "
          f"({min(best / by_rate, cpu) * 100:.2f}% of a core)")  # fmt: skip
    return {
        "scrub_cpu_s_per_gib": round(best, 3),
        "scrub_pass_s_per_gib": round(max(by_cpu, by_rate)),
    }


def load_table(c: LocalCluster, rows: int, dim: int, n_buckets: int) -> None:
    """A table of `rows` rows of `dim` (Adagrad), loaded by pushes of 100,000 rows."""
    t0 = time.monotonic()
    with PSClient(ControllerRouting(c.controllers), Layout([], n_buckets), c.token,
                  timeout=120.0) as client:  # fmt: skip
        client.create_table("idle_rows", dim, init={"kind": "normal", "std": 0.01, "seed": 1},
                            optimizer={"kind": "adagrad", "lr": 0.1})  # fmt: skip
        ids = np.random.default_rng(0).permutation(rows).astype(np.int64) * 7919 + 13
        grads = np.full((100_000, dim), 1e-3, np.float32)
        for s in range(0, rows, 100_000):
            part = ids[s : s + 100_000]
            client.push_rows("idle_rows", part, grads[: len(part)])
    print(f"{rows:,} rows of dim {dim} loaded in {time.monotonic() - t0:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window")
    ap.add_argument("--settle", type=float, default=10.0, help="wait after placement")
    ap.add_argument("--controllers", type=int, default=3)
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--buckets", type=int, default=64)
    ap.add_argument("--state-mb", type=float, default=16.0, help="model held (MB of float32)")
    ap.add_argument("--no-dataserver", action="store_true", help="no data server")
    ap.add_argument("--rows", type=int, default=0, help="rows of an embedding table to hold")
    ap.add_argument("--dim", type=int, default=16, help="the table's dim")
    ap.add_argument("--keep-open", action="store_true", help="leave the cluster up after")
    ap.add_argument("--threads", action="store_true", help="CPU and wakeups per thread too")
    ap.add_argument("--scrub-cost", type=float, default=0.0, metavar="MB", help="see above")
    a = ap.parse_args(argv)
    if a.scrub_cost > 0:
        print(json.dumps(scrub_cost(a.scrub_cost)))
        return 0

    root = tempfile.mkdtemp(prefix="adamps-idle-")
    c = LocalCluster(
        root, token=secrets.token_hex(16), n_controllers=a.controllers, n_servers=a.servers,
        n_buckets=a.buckets, controller_opts={"replication": min(3, a.servers)},
    )  # fmt: skip
    try:
        t0 = time.monotonic()
        c.start(timeout=120)
        if a.state_mb > 0:
            spec = TensorSpec("idle_w", (int(a.state_mb * (1 << 20)) // 4,))
            client = PSClient(ControllerRouting(c.controllers), Layout([spec], a.buckets), c.token)
            client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "adagrad", "lr": 0.01})
            # one push: every shard (values and accumulators) is written to LMDB by the next flush
            client.push_dense(spec.name, np.full(spec.shape, 0.1, np.float32))
            client.close()
        if a.rows > 0:
            load_table(c, a.rows, a.dim, a.buckets)
        if not a.no_dataserver:
            ds = c.start_dataserver("--source", "builtin", "--no-augment")
            c.procs["dataserver0"].wait_http(f"http://{ds}/healthz", 120)
        print(f"cluster placed in {time.monotonic() - t0:.1f} s; settling {a.settle:.0f} s")
        time.sleep(a.settle)
        members = {n: p.pid for n, p in c.procs.items()}
        t1, s1 = time.monotonic(), sample(c)
        th1 = {n: thread_stats(p) for n, p in members.items()} if a.threads else {}
        time.sleep(a.seconds)
        th2 = {n: thread_stats(p) for n, p in members.items()} if a.threads else {}
        t2, s2 = time.monotonic(), sample(c)
        dt = t2 - t1
        got = {n: used(s1[n], s2.get(n, {})) for n in s1}
        per = {n: cpu / dt for n, (cpu, _w) in got.items()}
        wake = {n: w / dt for n, (_cpu, w) in got.items()}
        load = os.getloadavg()
        print(f"idle for {dt:.1f} s; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
        print(f"{'process':<14}{'pid':>8}{'CPU-s/s':>10}{'wakeups/s':>11}")
        for n, v in per.items():
            print(f"{n:<14}{c.procs[n].pid:>8}{v:>10.4f}{wake[n]:>11.1f}")
        total = sum(per.values())
        print(f"{'total':<22}{total:>10.4f}{sum(wake.values()):>11.1f}   (goal <= 0.03 CPU-s/s)")
        threads = per_thread(c, th1, th2, dt) if a.threads else {}
        for n, ts in threads.items():
            for name, (cpu, w) in ts.items():
                print(f"  {n:<12}{name:<34}{cpu:>10.4f}{w:>11.1f}")
        out = {
            "idle_cluster_cpu_s_per_s": round(total, 4),
            "idle_cluster_wakeups_per_s": round(sum(wake.values()), 1),
            "per_process": {n: round(v, 4) for n, v in per.items()},
            "wakeups_per_s": {n: round(v, 1) for n, v in wake.items()},
            "seconds": round(dt, 1),
            "loadavg_1m": round(load[0], 2),
            "processes": len(per),
            "state_mb": a.state_mb,
            "rows": a.rows,
        }
        if threads:
            out["threads"] = threads
        if a.keep_open:
            print(json.dumps(out), flush=True)
            print("cluster left up (Ctrl-C stops it):", {n: p.pid for n, p in c.procs.items()})
            while True:
                time.sleep(3600)
        print(json.dumps(out))
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        c.stop()


if __name__ == "__main__":
    sys.exit(main())
