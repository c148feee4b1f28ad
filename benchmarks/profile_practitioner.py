"""Where the whole cluster's CPU goes in one of practitioner.py's settings: py-spy of every process.

Runs one setting of benchmarks/practitioner.py (default: the convnet, 2 replicas, RF 3: the
setting of ``convnet_rf3_2rep_cluster_ratio``) on its fresh cluster of 3 controllers and 3
parameter servers, and once the replicas train, records every process (each controller, each
server, each replica) with ``py-spy record`` for ``--duration`` seconds, all at once, while reading
each process's CPU seconds from /proc over the same window. Prints the CPU per process kind
(controllers, servers, replicas) and, per process, benchmarks/profile_cluster.py's summary: the
share of samples waiting, in socket I/O and working, and the top working functions and lines.

    python benchmarks/profile_practitioner.py [--workload convnet] [--replicas 2] [--rf 3]
        [--epochs 4] [--duration 15] [--rate 50] [--out runs/profile-practitioner]

py-spy samples each process at ``--rate`` Hz (lower than its 100 Hz default: nine samplers share
the cores with what they sample). py-spy is a benchmark-only dependency (``adamps[bench]``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.profile_cluster import cpu_seconds, descendants, summarize  # noqa: E402

CHILD = """
import json, sys, tempfile
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, {root!r})
import benchmarks.practitioner as P
s = P.Setting({workload!r}, replicas={replicas}, rf={rf}, batch=32, epochs={epochs},
              optimizer={opt!r}, lr={lr})
r = P.run_setting(s, Path(tempfile.mkdtemp(prefix="adamps-profprac-")))
print("RESULT " + json.dumps(r), flush=True)
"""


def kind_of(args: list[str]) -> str | None:
    """controller / ps / replica, from a process's argv (None: not one of the cluster's)."""
    if args[1:3] == ["-m", "adamps"] and len(args) > 3 and args[3] in ("controller", "ps"):
        return args[3]
    if any("spawn_main" in a for a in args) and not any("resource_tracker" in a for a in args):
        return "replica"
    return None


def find(pid: int, replicas: int, timeout: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found: dict[str, int] = {}
        n = {"controller": 0, "ps": 0, "replica": 0}
        for p, args in sorted(descendants(pid).items()):
            k = kind_of(args)
            if k is not None:
                found[f"{k}{n[k]}"] = p
                n[k] += 1
        if n["replica"] >= replicas and n["ps"] >= 3 and n["controller"] >= 3:
            return found
        time.sleep(0.2)
    raise TimeoutError("the cluster's processes and replicas did not all start")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="convnet", choices=("convnet", "transformer"))
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--rf", type=int, default=3)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--duration", type=int, default=15, help="seconds recorded")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds after the replicas start")
    ap.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "runs" / "profile-practitioner"))
    a = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    opt, lr = ("sgd", 0.05) if a.workload == "convnet" else ("adagrad", 0.02)
    code = CHILD.format(root=str(ROOT), workload=a.workload, replicas=a.replicas, rf=a.rf,
                        epochs=a.epochs, opt=opt, lr=lr)  # fmt: skip
    bench = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = find(bench.pid, a.replicas, 300)
        time.sleep(a.warmup)
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t0 = time.monotonic()
        spies = {
            k: subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(p),
                    "--duration",
                    str(a.duration),
                    "--rate",
                    str(a.rate),
                    "--nonblocking",
                    "--format",
                    "speedscope",
                    "--output",
                    str(out / f"{k}.speedscope.json"),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )  # fmt: skip
            for k, p in pids.items()
        }
        time.sleep(a.duration)
        window = time.monotonic() - t0
        cpu = {k: cpu_seconds(p) - cpu0[k] for k, p in pids.items()}
        for k, sp in spies.items():
            _, err = sp.communicate(timeout=120)
            if sp.returncode != 0:
                print(f"py-spy on {k} failed: {err.decode(errors='replace')[-300:]}")
        by_kind: dict[str, float] = {}
        for k, c in cpu.items():
            kind = k.rstrip("0123456789")
            by_kind[kind] = by_kind.get(kind, 0.0) + (c if c == c else 0.0)
        print(f"CPU seconds in the {window:.1f} s window: "
              + ", ".join(f"{k} {c:.2f}" for k, c in cpu.items()))  # fmt: skip
        print("by kind: " + ", ".join(f"{k} {c:.2f}" for k, c in by_kind.items()), flush=True)
        for k in pids:
            f = out / f"{k}.speedscope.json"
            print(f"  {k} (pid {pids[k]}):")
            if f.exists():
                print("\n".join(summarize(f, a.top, cpu[k])), flush=True)
        text, _ = bench.communicate(timeout=1800)
    finally:
        if bench.poll() is None:
            bench.terminate()
            bench.wait(60)
    for line in (text or "").splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            print(f"setting: {r['examples']} examples, trainers {r['trainer_cpu_s']:.2f} CPU-s, "
                  f"servers+controllers {r['servers_cpu_s']:.2f} CPU-s, wall {r['wall_s']:.1f} s")  # fmt: skip
    return bench.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
