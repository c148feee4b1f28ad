"""Where a training cluster's CPU goes: py-spy profiles of its server, a trainer and its data server.

Runs benchmarks/accuracy_cluster.py (1 parameter server, 1 data server, `--replicas` trainers as
real processes) and, once the trainers train, records each of the parameter server, the data server
and trainer 0 (with its worker processes: --subprocesses) for `--duration` seconds with
`py-spy record --format speedscope` (all three at once), while reading each
process's CPU seconds from /proc over the same window. py-spy's idle detection does not work in
this container (waiting threads are sampled as active), so each sample is classified by the source
line it stands on: waiting (a queue get, a condition wait, select, sleep), socket I/O, or working.
Per process it prints the CPU used in the window, those shares, and the top working functions (own
time), lines and callers (total time): the tables `py-spy top` shows interactively, computed from
the recorded samples. The speedscope files stay in `--out` (open them at speedscope's web app).
Last: accuracy_cluster.py's own output (images per CPU second of the cluster against one process).

    python benchmarks/profile_cluster.py [--duration 20] [--out runs/profile] [--top 12]
        [-- accuracy_cluster.py options, e.g. --epochs 8]

py-spy is a benchmark-only dependency (`pip install 'adamps[bench]'`).
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import re
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
    except OSError:  # gone: its CPU in a window that outlived it is unknown, not negative
        return float("nan")
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


#: a leaf line that blocks: py-spy here counts waiting threads as active (its idle detection
#: does not work in this container: 45 s of samples in 20 s from a server that used 2 CPU s),
#: so samples are classified by the source line they stand on
WAITING = re.compile(r"\.get\(|\.wait\(|select\(|sleep\(|\.acquire\(|\.join\(|\.poll\(|accept\(")
SOCKET = re.compile(r"recv|readinto|sendall|\.send\(|_recv_bytes")


def summarize(path: Path, top: int, cpu_s: float) -> list[str]:
    """Where one process's samples stand (waiting / socket I/O / working) and the top working
    functions and lines, from one speedscope file (all its threads and subprocesses)."""
    doc = json.loads(path.read_text())
    frames = doc["shared"]["frames"]

    def func(i: int) -> str:
        f = frames[i]
        file = f.get("file") or ""
        short = file.split("site-packages/")[-1].replace(str(ROOT) + "/", "")
        return f"{f['name']} ({short})" if file else f["name"]

    def where(i: int) -> tuple[str, str]:
        f = frames[i]
        text = linecache.getline(f.get("file") or "", f.get("line") or 0).strip()
        return f"{func(i)}:{f.get('line')}", text

    kinds: Counter[str] = Counter()
    self_c: Counter[str] = Counter()
    lines_c: Counter[tuple[str, str]] = Counter()
    total_c: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    n = 0.0
    for prof in doc["profiles"]:
        for stack, w in zip(prof["samples"], prof["weights"], strict=True):
            if not stack:
                continue
            n += w
            loc, text = where(stack[-1])
            kind = (
                "waiting"
                if WAITING.search(text)
                else "socket"
                if SOCKET.search(text)
                else "working"
            )
            kinds[kind] += w
            if kind != "working":
                continue
            self_c[func(stack[-1])] += w
            threads[prof["name"]] += w
            lines_c[(loc, text)] += w
            for fn in {func(i) for i in stack}:
                total_c[fn] += w
    work = kinds["working"]
    if not work:
        return ["    no working samples"]
    out = [
        f"    {n:.1f} s of samples: waiting {kinds['waiting'] / n:.0%} (queue get, condition wait, "
        f"select, sleep), socket reads/writes {kinds['socket'] / n:.0%}, working "
        f"{work / n:.0%} = {work:.1f} s (the process used {cpu_s:.1f} CPU s)",
        "    working samples by thread: "
        + ", ".join(f"{t} {c / work:.0%}" for t, c in threads.most_common(8)),
        f"    top {top} functions by own time, share of working samples:",
    ]
    out += [f"      {c / work:6.1%}  {f}" for f, c in self_c.most_common(top)]
    out.append(f"    top {top} lines, share of working samples:")
    out += [
        f"      {c / work:6.1%}  {loc}  {text[:70]}" for (loc, text), c in lines_c.most_common(top)
    ]
    out.append(
        f"    top {top} by total time (the function and what it calls), share of working samples:"
    )
    skip = ("_bootstrap", "<module>", "run_role", "_run_code", "spawn_main", "_main (", "process ")
    tot = [(f, c) for f, c in total_c.most_common() if not any(k in f for k in skip)]
    out += [f"      {c / work:6.1%}  {f}" for f, c in tot[:top]]
    return out


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
                   "--format", "speedscope",
                   "--output", str(out / f"{role}.speedscope.json")]  # fmt: skip
            if role.startswith("train"):
                cmd.append("--subprocesses")
            spies[role] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        time.sleep(args.duration)
        window = time.monotonic() - t0
        cpu = {r: cpu_seconds(pid) - cpu0[r] for r, pid in pids.items()}
        for t in [t for t in pids if t.startswith("train")]:
            ended = cpu[t] != cpu[t]  # nan: the trainer, and so its workers, ended
            cpu[f"{t}_workers"] = (
                float("nan")
                if ended
                else sum(cpu_seconds(p) - workers0.get(p, 0.0) for p in descendants(pids[t]))
            )
        for role, sp in spies.items():
            _, err = sp.communicate(timeout=120)
            if sp.returncode != 0:
                print(f"py-spy on {role} failed: {err.decode(errors='replace')[-500:]}")
        print(f"py-spy record, {args.duration} s, while benchmarks/accuracy_cluster.py "
              f"{' '.join(args.cluster_args)} trains; CPU seconds in the {window:.1f} s window: "
              + ", ".join(f"{r} {c:.1f}" if c == c else f"{r} (ended before the window)"
                          for r, c in cpu.items()), flush=True)  # fmt: skip
        for role in PROFILED:
            f = out / f"{role}.speedscope.json"
            print(f"  {role} (pid {pids[role]}; {f}):")
            if f.exists():
                cpu_role = cpu[role] + cpu.get(f"{role}_workers", 0.0)
                print("\n".join(summarize(f, args.top, cpu_role)), flush=True)
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
