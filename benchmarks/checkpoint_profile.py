"""Where a checkpoint's save and restore spend their time (issue 38 item 7): cProfile of the
client, py-spy of the three parameter servers and of the client's threads, over one save and one restore of a
``--gb`` GB model (16 tensors, SGD, RF 3, 16 buckets), as benchmarks/checkpoint.py makes it.

Per phase it prints the wall time, each server's CPU seconds (/proc) and the client's, the
client's top functions by cumulative time, and each server's top frames (own samples,
py-spy's raw output, idle waits included: read the frames named). Files stay in ``--out``.

    python benchmarks/checkpoint_profile.py [--gb 0.25] [--out runs/ckpt-profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path

from adamps.checkpoint import cluster as ckpt_cluster
from adamps.checkpoint.restore import restore
from adamps.checkpoint.save_restore import Cluster, save
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from benchmarks.checkpoint import N_BUCKETS, SHARD, TOKEN, start
from benchmarks.profile_cluster import cpu_seconds

#: the errors the client's calls retried (code and message head), per phase
RETRIED: Counter[str] = Counter()
_retryable = ckpt_cluster.retryable


def _counted(exc: BaseException) -> bool:
    ok = _retryable(exc)
    if ok:
        RETRIED[f"{getattr(exc, 'code', type(exc).__name__)}: {str(exc)[:90]}"] += 1
    return ok


ckpt_cluster.retryable = _counted

PY_SPY = Path(os.environ.get("VIRTUAL_ENV", "/work/venv")) / "bin" / "py-spy"


def phase(name: str, servers: list[int], out: Path, fn, top: int) -> None:  # noqa: ANN001
    spies = [subprocess.Popen([str(PY_SPY), "record", "--pid", str(pid), "--rate", "200",
                               "--format", "raw", "--nonblocking", "-o", str(out / f"{name}-ps{i}.txt")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for i, pid in enumerate([*servers, os.getpid()])]  # fmt: skip
    time.sleep(1.0)  # py-spy attached
    cpu0 = [cpu_seconds(p) for p in servers]
    me0 = time.process_time()
    RETRIED.clear()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    fn()
    prof.disable()
    wall = time.perf_counter() - t0
    cpu = [cpu_seconds(p) - c for p, c in zip(servers, cpu0, strict=True)]
    me = time.process_time() - me0
    for s in spies:
        s.send_signal(2)
    for s in spies:
        s.wait(timeout=30)
    print(
        f"== {name}: {wall:.2f} s wall; client CPU {me:.2f} s; servers' CPU "
        f"{', '.join(f'{c:.2f}' for c in cpu)} s (load {os.getloadavg()[0]:.1f})"
    )
    print(f"retried: {dict(RETRIED.most_common(5)) or 'nothing'}")
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(top)
    (out / f"{name}-client.txt").write_text(buf.getvalue())
    print("\n".join(buf.getvalue().splitlines()[: top + 12]))
    for i in range(len(servers) + 1):
        who = f"ps{i}" if i < len(servers) else "client"  # the client: all its threads
        own: Counter[str] = Counter()
        total = 0
        path = out / f"{name}-ps{i}.txt"
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            stack, _, n = line.rpartition(" ")
            frames = stack.split(";")
            own[frames[-1]] += int(n)
            total += int(n)
        print(f"-- {who} own frames ({total} samples):")
        for f, n in own.most_common(top):
            print(f"  {100 * n / max(total, 1):5.1f}%  {f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gb", type=float, default=0.25)
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--out", default="runs/ckpt-profile")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--save-only", action="store_true", help="profile the save, not the restore")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    per = int(args.gb * (1 << 30) / 4 / args.tensors)
    specs = [TensorSpec(f"t{i}", (per,)) for i in range(args.tensors)]
    layout = Layout(specs, n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    root = tempfile.mkdtemp(prefix="adamps-ckpt-profile-")
    ckpt = Path(root) / "ckpt"
    a = start(os.path.join(root, "a"))
    try:
        client = PSClient(ControllerRouting(a.controllers), layout, TOKEN, retry_for=60.0)
        for i, s in enumerate(specs):
            client.create(s, init={"kind": "normal", "std": 0.01, "seed": i},
                          optimizer={"kind": "sgd", "lr": 0.1})  # fmt: skip
        client.close()
        cl = Cluster(a.controllers, TOKEN, retry_for=120.0)
        pids = [a.procs[s].pid for s in a.server_ids]
        phase("save", pids, out, lambda: save(cl, ckpt), args.top)
    finally:
        a.stop()
    if args.save_only:
        shutil.rmtree(root, ignore_errors=True)
        return
    b = start(os.path.join(root, "b"))
    try:
        cl = Cluster(b.controllers, TOKEN, retry_for=120.0)
        pids = [b.procs[s].pid for s in b.server_ids]
        phase("restore", pids, out, lambda: restore(cl, ckpt), args.top)
    finally:
        b.stop()
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
