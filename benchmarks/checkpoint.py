"""Checkpoint save and restore throughput, and what periodic checkpoints cost training
(issue 24), from one run on this machine.

A real cluster on loopback (3 controllers, 3 parameter servers, replication 3) holds a model of
``--gb`` GB of float32 values (``--tensors`` tensors, SGD). Figures:

- save: ``adamps checkpoint save`` (adamps.checkpoint.save_restore.save) of the whole model, in GB/s of
  values written, against the limit: a plain ``np.save`` of the same arrays to the same disk
  (each file fsynced, as the checkpoint's are), in the same run. Goal >= 0.5.
- restore: ``adamps checkpoint restore`` onto a second, empty cluster of 3 servers, against
  ``np.load`` of the np.save files, in the same run. Goal >= 0.5.
- training: pushes/s of a dense push load (4 threads, whole shards) while a checkpoint is saved
  every ``--interval`` seconds, each incremental on the one before and pruned to 2, as the
  controllers' leader takes them (controller/ckpt_schedule.py; run here by the script so that
  the same cluster measures both), against the same load with none. Goal >= 0.9.
- consistent stall: ``adamps checkpoint save --consistent`` under the same push load, 3 times:
  how long writes were held (``hold_ms``, from the first hold sent to the last release
  answered) and the longest drain + marking of one server (``hold_server_ms``), in ms.

    python benchmarks/checkpoint.py [--gb 1.0] [--tensors 16] [--seconds 30] [--interval 10]

Last line: one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from adamps.checkpoint import series as ckpt_series
from adamps.checkpoint.restore import restore
from adamps.checkpoint.save_restore import Cluster, save
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import LocalCluster

TOKEN = "bench-token"
N_BUCKETS = 16
SHARD = 1 << 18  # 1 MB shards (the default)


def start(root: str) -> LocalCluster:
    c = LocalCluster(
        root, token=TOKEN, n_servers=3, n_buckets=N_BUCKETS,
        # The default timings: creating 1 GB of tensors stalls a server's loop for longer than
        # the tests' fast timings allow on 2 cores.
        ps_opts={"max-shard-elems": SHARD, "max-server-elems": 1 << 30,
                 "flush-interval": 1.0},
    )  # fmt: skip
    c.start(timeout=120)
    return c


def np_save_limit(arrays: dict[str, np.ndarray], d: str) -> tuple[float, float]:
    """Seconds of np.save of every array (each file fsynced) and of np.load of them back."""
    os.makedirs(d, exist_ok=True)
    t0 = time.perf_counter()
    for name, a in arrays.items():
        path = os.path.join(d, f"{name}.npy")
        with open(path, "wb") as f:
            np.save(f, a)
            f.flush()
            os.fsync(f.fileno())
    t_save = time.perf_counter() - t0
    t0 = time.perf_counter()
    total = 0.0
    for name in arrays:
        total += float(np.load(os.path.join(d, f"{name}.npy"))[0])
    t_load = time.perf_counter() - t0
    return t_save, t_load


def push_rate(client: PSClient, layout: Layout, seconds: float, threads: int,
              during: threading.Event | None = None) -> float:  # fmt: skip
    """Pushes/s of `threads` threads pushing a small dense delta to whole shards."""
    shards = [s for sh in layout.shards_of.values() for s in sh]
    stop = threading.Event()
    counts = [0] * threads

    def run(k: int) -> None:
        rng = np.random.default_rng(k)
        d = np.full(SHARD, 1e-6, np.float32)
        while not stop.is_set():
            s = shards[int(rng.integers(len(shards)))]
            client.push_shards({s.id: d[: s.size].reshape(s.shape)})
            counts[k] += 1

    ts = [threading.Thread(target=run, args=(k,), daemon=True) for k in range(threads)]
    t0 = time.perf_counter()
    for t in ts:
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=4)
    args = p.parse_args()
    per = int(args.gb * (1 << 30) / 4 / args.tensors)
    specs = [TensorSpec(f"t{i}", (per,)) for i in range(args.tensors)]
    layout = Layout(specs, n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    nbytes = 4 * per * args.tensors
    root = tempfile.mkdtemp(prefix="adamps-bench-ckpt-")
    figures: dict[str, float | None] = {"model_gb": nbytes / 1e9}
    a = start(os.path.join(root, "a"))
    try:
        client = PSClient(ControllerRouting(a.controllers), layout, TOKEN, retry_for=60.0)
        for i, s in enumerate(specs):
            client.create(s, init={"kind": "normal", "std": 0.01, "seed": i},
                          optimizer={"kind": "sgd", "lr": 0.1})  # fmt: skip
        cl = Cluster(a.controllers, TOKEN, retry_for=120.0)
        ckpt = os.path.join(root, "ckpt")
        t0 = time.perf_counter()
        save(cl, Path(ckpt))
        t_ckpt = time.perf_counter() - t0
        values, _ = client.pull([s.name for s in specs])
        t_npsave, t_npload = np_save_limit(values, os.path.join(root, "npy"))
        shutil.rmtree(os.path.join(root, "npy"))
        print(f"save:    {nbytes / t_ckpt / 1e9:.3f} GB/s ({t_ckpt:.2f} s); np.save "
              f"{nbytes / t_npsave / 1e9:.3f} GB/s ({t_npsave:.2f} s); "
              f"ratio {t_npsave / t_ckpt:.2f} (goal >= 0.5)")  # fmt: skip
        figures |= {"save_gb_s": nbytes / t_ckpt / 1e9, "np_save_gb_s": nbytes / t_npsave / 1e9,
                    "save_ratio": t_npsave / t_ckpt}  # fmt: skip
        # Training with and without a checkpoint every `interval` seconds.
        base = push_rate(client, layout, args.seconds, args.threads)
        stop = threading.Event()
        saves: list[float] = []

        series = Path(root) / "series"
        written: list[int] = []

        def periodic() -> None:
            n = 0
            while not stop.wait(args.interval):
                t = time.perf_counter()
                n += 1
                m = save(cl, series / ckpt_series.name_of(n, 1), base=ckpt_series.newest(series))
                ckpt_series.prune(series, 2)
                saves.append(time.perf_counter() - t)
                written.append(m["written_bytes"])

        th = threading.Thread(target=periodic, daemon=True)
        th.start()
        with_ckpt = push_rate(client, layout, args.seconds, args.threads)
        stop.set()
        th.join()
        print(f"train:   {with_ckpt:.1f} pushes/s with a checkpoint every {args.interval:g} s "
              f"({len(saves)} saves, {np.mean(saves) if saves else 0:.2f} s each); "
              f"{base:.1f} pushes/s with none; ratio {with_ckpt / base:.2f} (goal >= 0.9)")  # fmt: skip
        figures |= {"train_pushes_s": base, "train_with_ckpt_pushes_s": with_ckpt,
                    "train_ratio": with_ckpt / base, "periodic_saves": len(saves),
                    "periodic_written_gb": [w / 1e9 for w in written]}  # fmt: skip
        # The stall of a consistent cut under the same load.
        holds: list[tuple[float, float]] = []

        def consistent() -> None:
            for k in range(3):
                time.sleep(1.0)
                m = save(cl, Path(root) / f"consistent-{k}", consistent=True)
                holds.append((m["hold_ms"], m["hold_server_ms"]))
                shutil.rmtree(Path(root) / f"consistent-{k}")

        th = threading.Thread(target=consistent, daemon=True)
        th.start()
        under = push_rate(client, layout, max(args.seconds, 5.0), args.threads)
        th.join()
        hms = [h for h, _ in holds]
        print(f"consistent: writes held {', '.join(f'{h:.0f}' for h in hms)} ms "
              f"(servers' drain + mark {', '.join(f'{s:.0f}' for _, s in holds)} ms) under "
              f"{under:.1f} pushes/s")  # fmt: skip
        figures |= {"consistent_stall_ms": max(hms) if hms else None,
                    "consistent_stall_ms_all": hms,
                    "consistent_server_ms_all": [s for _, s in holds]}  # fmt: skip
        client.close()
    finally:
        a.stop()
    b = start(os.path.join(root, "b"))
    try:
        cl = Cluster(b.controllers, TOKEN, retry_for=120.0)
        t0 = time.perf_counter()
        restore(cl, Path(ckpt))
        t_rest = time.perf_counter() - t0
        print(f"restore: {nbytes / t_rest / 1e9:.3f} GB/s ({t_rest:.2f} s); np.load "
              f"{nbytes / t_npload / 1e9:.3f} GB/s ({t_npload:.2f} s); "
              f"ratio {t_npload / t_rest:.2f} (goal >= 0.5)")  # fmt: skip
        figures |= {"restore_gb_s": nbytes / t_rest / 1e9,
                    "np_load_gb_s": nbytes / t_npload / 1e9, "restore_ratio": t_npload / t_rest}  # fmt: skip
    finally:
        b.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
