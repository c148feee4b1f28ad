"""Where a training cluster's CPU goes: py-spy profiles of its server, a trainer and its data server.

Runs benchmarks/accuracy_cluster.py (1 parameter server, 1 data server, `--replicas` trainers as
real processes) and, once the trainers train, records each of the parameter server, the data server
and trainer 0 (with its worker processes: --subprocesses) for `--duration` seconds with
`py-spy record --format speedscope --function` (all three at once), while reading each
process's CPU seconds from /proc over the same window. Then it prints, per process, the CPU it used
in the window and its top functions by own time ("self", the leaf of each sample) and by time
inside them ("total"), as shares of that process's samples: the tables `py-spy top` shows
interactively, computed from the recorded samples. The speedscope files stay in `--out` (open them
at speedscope's web app). Last: accuracy_cluster.py's own output (images per CPU second of the
cluster against one process).

    python benchmarks/profile_cluster.py [--duration 20] [--out runs/profile] [--top 12]
        [-- accuracy_cluster.py options, e.g. --epochs 8]

py-spy is a benchmark-only dependency (`pip install 'adamps[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: CPU seconds of all threads of a process, from /proc/<pid>/stat (utime + stime)
TICK = os.sysconf("SC_CLK_TCK")
#: the processes recorded (the other trainers do the same work as trainer 0)
PROFILED = ("ps", "dataserver", "train0")


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def descendants(pid: int) -> dict[int, list[str]]:
    """pid -> argv of every process below `pid` (Linux /proc)."""
    parent: dict[int, int] = {}
    argv: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            args = (d / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        parent[int(d.name)] = ppid
        argv[int(d.name)] = [a.decode(errors="replace") for a in args if a]
    out = {}
    for p in parent:
        q = p
        while q in parent and q != pid:
            q = parent[q]
        if q == pid and p != pid:
            out[p] = argv[p]
    return out


def find_roles(pid: int, timeout: float) -> dict[str, int]:
    """The pids of `adamps ps`, `adamps dataserver` and every trainer below `pid`, once the
    server, the data server and trainer 0 run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        roles = {}
        for p, args in descendants(pid).items():
            if args[1:3] == ["-m", "adamps"] and len(args) > 3:
                role = args[3]
                if role == "train" and "--replica" in args:
                    role = f"train{args[args.index('--replica') + 1]}"
                roles[role] = p
        if {"ps", "dataserver", "train0"} <= roles.keys():
            return dict(sorted(roles.items()))
        time.sleep(0.2)
    raise TimeoutError("the cluster's processes did not all start")


def summarize(path: Path, top: int) -> list[str]:
    """Self and total shares of the functions in one speedscope file (all its threads)."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]

    def name(i: int) -> str:
        f = frames[i]
        file = f.get("file", "")
        return f"{f['name']} ({file.split('site-packages/')[-1]})" if file else f["name"]

    self_c: Counter[str] = Counter()
    total_c: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    n = 0
    for prof in doc["profiles"]:
        for stack, w in zip(prof["samples"], prof["weights"], strict=True):
            if not stack:
                continue
            n += w
            threads[prof["name"]] += w
            self_c[name(stack[-1])] += w
            for fn in {name(i) for i in stack}:
                total_c[fn] += w
    if not n:
        return ["    no samples (the process was idle or exited)"]
    lines = [f"    {n:.1f} s of active samples (py-spy leaves out idle threads); by thread: "
             + ", ".join(f"{t} {c / n:.0%}" for t, c in threads.most_common(6))]  # fmt: skip
    lines.append(f"    top {top} by self time:")
    lines += [f"      {c / n:6.1%}  {f}" for f, c in self_c.most_common(top)]
    lines.append(f"    top {top} by total time (the function and what it calls):")
    lines += [f"      {c / n:6.1%}  {f}" for f, c in total_c.most_common(top)]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=20, help="seconds recorded")
    p.add_argument("--warmup", type=float, default=8.0,
                   help="seconds after trainer 0 starts before recording (data loading, first pull)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "runs" / "profile"), help="speedscope files here")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("cluster_args", nargs="*", help="options of accuracy_cluster.py (after --)")
    args = p.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        print("py-spy is not installed (pip install 'adamps[bench]')")
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    bench = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "accuracy_cluster.py"), *args.cluster_args],
        stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    captured: list[str] = []
    reader = threading.Thread(target=lambda: captured.extend(bench.stdout or []), daemon=True)
    reader.start()
    try:
        pids = find_roles(bench.pid, 300)
        time.sleep(args.warmup)
        cpu0 = {r: cpu_seconds(pid) for r, pid in pids.items()}
        workers0 = {p: cpu_seconds(p) for t in pids if t.startswith("train")
                    for p in descendants(pids[t])}  # fmt: skip
        t0 = time.monotonic()
        spies = {}
        for role, pid in pids.items():
            if role not in PROFILED:
                continue
            cmd = [spy, "record", "--pid", str(pid), "--duration", str(args.duration),
                   "--format", "speedscope", "--function",
                   "--output", str(out / f"{role}.speedscope.json")]  # fmt: skip
            if role.startswith("train"):
                cmd.append("--subprocesses")
            spies[role] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(args.duration)
        window = time.monotonic() - t0
        cpu = {r: cpu_seconds(pid) - cpu0[r] for r, pid in pids.items()}
        for t in [t for t in pids if t.startswith("train")]:
            cpu[f"{t}_workers"] = sum(
                cpu_seconds(p) - workers0.get(p, 0.0) for p in descendants(pids[t])
            )
        for role, sp in spies.items():
            _, err = sp.communicate(timeout=120)
            if sp.returncode != 0:
                print(f"py-spy on {role} failed: {err.decode(errors='replace')[-500:]}")
        print(f"py-spy record, {args.duration} s, while benchmarks/accuracy_cluster.py "
              f"{' '.join(args.cluster_args)} trains; CPU seconds in the {window:.1f} s window: "
              + ", ".join(f"{r} {c:.1f}" for r, c in cpu.items()), flush=True)  # fmt: skip
        for role in PROFILED:
            f = out / f"{role}.speedscope.json"
            print(f"  {role} (pid {pids[role]}; {f}):")
            if f.exists():
                print("\n".join(summarize(f, args.top)), flush=True)
        bench.wait(1800)
        reader.join(10)
    finally:
        if bench.poll() is None:
            bench.terminate()
            bench.wait(30)
    print("benchmarks/accuracy_cluster.py output:")
    print("".join(captured), end="")
    return bench.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
