"""`adamps up --partitions 2`: the local cluster with each replica cut into 2 processes trains
to the target, and every process it started (partitions and their Hogwild workers included)
is gone when it exits."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from adamps.up.procs import adamps_argv

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(240)
def test_up_with_two_partitions_per_replica(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = tmp_path / "up.out"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ADAMPS_TOKEN", None)
    seen: set[int] = set()
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            adamps_argv("up", "--run-dir", str(run), "--no-progress", "--epochs", "2",
                        "--partitions", "2", "--target-accuracy", "0.9"),
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=ROOT, start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 200
            while proc.poll() is None and time.monotonic() < deadline:
                seen |= descendants(proc.pid)
                time.sleep(0.5)
            code = proc.wait(10)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
    text = out.read_text()
    assert code == 0, text
    acc = re.search(r"^held-out accuracy: ([0-9.]+)% after 2 epochs", text, re.M)
    assert acc and float(acc.group(1)) >= 90.0, text
    logs = (run / "logs" / "train0.log").read_text()
    assert "[partition 1]" in logs and "train[0/p1]" in logs, logs[-2000:]
    # 2 launchers, 4 partitions and their workers, besides the 7 servers
    assert len(seen) >= 7 + 2 + 4 + 4, seen
    deadline = time.monotonic() + 10
    while any(alive(p) for p in seen) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in seen if alive(p)]
