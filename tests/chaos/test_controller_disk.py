"""A controller whose data directory fills up (issue 39, finding 5): three real controller
processes, each on a small tmpfs of its own; the leader's is filled while writes go on.

Before: pysyncobj's memory-mapped journal grew into a hole on the full disk and the leader died
with SIGBUS at its next entry. Now (controller/raft_journal.py) it stays up, steps down and
stands aside (no leading, voting or acknowledging), says so (log, /status raft.journal,
adamps_controller_journal_writable), and takes part again once space is back. Every step
compares the replicated state of the members by its digest (GET /state/digest), also across a
restart while the disk is full and a restart after it was freed. Needs root (mounts).
"""

from __future__ import annotations

import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from adamps.up.procs import adamps_argv
from tests.chaos import disks
from tests.system.test_controller_raft import TOKEN, Controllers, call

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

#: each controller's tmpfs: the journal's reserve (2 MiB) and dumps fit many times over
TMPFS = "16m"


class Writer(threading.Thread):
    """Progress reports, one Raft entry each, sent to whichever controller answers; keeps the
    acknowledged ones (they must all be in the final state)."""

    def __init__(self, ctl: Controllers) -> None:
        super().__init__(daemon=True)
        self.ctl = ctl
        self.stopped = threading.Event()
        self.acked: list[str] = []
        self.k = 0

    def run(self) -> None:
        while not self.stopped.is_set():
            self.k += 1
            replica = f"r{self.k % 50}-{self.k}"
            body = {"epoch": self.k // 50, "replica": replica, "progress": 0.5}
            for i in range(len(self.ctl.http)):
                code, _ = call(self.ctl.http[i], "POST", "/progress", body, timeout=3.0)
                if code == 200:
                    self.acked.append(f"{self.k // 50}/{replica}")
                    break
            time.sleep(0.02)

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=10)


def digest(ctl: Controllers, i: int) -> dict[str, Any] | None:
    code, body = call(ctl.http[i], "GET", "/state/digest", timeout=5.0)
    return body if code == 200 else None


def journal_gauge(ctl: Controllers, i: int) -> float | None:
    req = urllib.request.Request(f"http://{ctl.http[i]}/metrics")
    req.add_header("Authorization", f"Bearer {TOKEN}")
    with urllib.request.urlopen(req, timeout=3) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("adamps_controller_journal_writable "):
                return float(line.split()[1])
    return None


def wait_for(what: str, cond: Any, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"not within {timeout}s: {what}")


def same_state(ctl: Controllers, members: list[int]) -> bool:
    ds = [digest(ctl, i) for i in members]
    return all(ds) and len({d["digest"] for d in ds}) == 1  # type: ignore[index]


def test_a_controller_whose_disk_fills_steps_down_stands_aside_and_rejoins(
    procs, tmp_path: Path
) -> None:
    reason = disks.cannot_mount()
    if reason:
        pytest.skip(reason)
    mounts: list[Path] = []
    ctl = Controllers(procs, tmp_path, **{"compaction-entries": 50})
    writer = Writer(ctl)
    try:
        for i in range(3):
            at = tmp_path / f"c{i}"
            at.mkdir()
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={TMPFS}", "tmpfs", str(at)], check=True
            )
            mounts.append(at)
        ctl.start_all()
        full = ctl.leader()
        others = [i for i in range(3) if i != full]
        writer.start()
        wait_for("writes committed", lambda: len(writer.acked) >= 30)

        # The leader's disk fills while writes go on.
        disks.fill(mounts[full])

        def stood_aside() -> dict[str, Any] | None:
            proc = ctl.proc[full]
            assert proc.alive, f"the full controller died (exit {proc.returncode}):\n{proc.tail()}"
            s = ctl.status(full)
            if s and s["role"] != "leader" and not s.get("journal", {}).get("writable", True):
                return s
            return None

        st = wait_for("the full controller steps down and says why", stood_aside)
        assert "No space left" in st["journal"]["error"], st["journal"]
        new = ctl.leader(among=others, timeout=20)
        assert new != full
        n = len(writer.acked)
        wait_for("writes go on without it", lambda: len(writer.acked) >= n + 30)
        assert journal_gauge(ctl, full) == 0.0
        assert journal_gauge(ctl, new) == 1.0
        time.sleep(3)  # it keeps standing aside, alive: no SIGBUS, no election of its own
        assert ctl.proc[full].alive, f"exit {ctl.proc[full].returncode}:\n{ctl.proc[full].tail()}"
        st = ctl.status(full)
        assert st is not None and st["role"] != "leader" and not st["journal"]["writable"]
        assert ctl.leader(among=others) == new
        log = ctl.proc[full].log_path.read_text(errors="replace")
        assert "stands aside" in log and "stepping down as leader" in log
        # `adamps status`, asked the full one first, shows it and reads the state elsewhere.
        order = ",".join(ctl.http[i] for i in [full, *others])
        out = subprocess.run(
            adamps_argv("status", "--controllers", order),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "NOT WRITABLE: cannot" in out.stdout and "table version" in out.stdout, out.stdout

        # Killed and restarted while its disk is still full: it starts, and stands aside.
        ctl.kill(full)
        ctl.start(full)
        wait_for("restarted on a full disk, it stands aside", stood_aside)
        time.sleep(2)
        assert ctl.proc[full].alive, ctl.proc[full].tail()
        assert ctl.leader(among=others) == new

        # Space returns: it takes part again and catches up.
        disks.unfill(mounts[full])
        wait_for("writable again", lambda: (s := ctl.status(full)) and s["journal"]["writable"])
        writer.stop()
        wait_for("all three apply the same state", lambda: same_state(ctl, [0, 1, 2]), 30)
        assert journal_gauge(ctl, full) == 1.0 or wait_for(
            "gauge back to 1", lambda: journal_gauge(ctl, full) == 1.0, 5
        )

        wait_for(
            "every member compacted its log into a full dump",
            lambda: all((m / "raft.dump").exists() for m in mounts),
        )
        # A restart after it all: the state it rebuilds from its journal and dump is the others'.
        ctl.kill(full)
        ctl.start(full)
        ctl.proc[full].wait_http(f"http://{ctl.http[full]}/healthz", timeout=20)
        wait_for("equal states after the restart", lambda: same_state(ctl, [0, 1, 2]), 30)
        code, prog = call(ctl.http[full], "GET", "/progress")
        assert code == 200
        held = {f"{e}/{r}" for e, reps in prog["epochs"].items() for r in reps}
        lost = [a for a in writer.acked if a not in held]
        assert not lost, f"acknowledged writes missing: {lost[:5]}"
        diverged = "may have diverged" in ctl.proc[full].log_path.read_text(errors="replace")
        print(
            f"{len(writer.acked)} writes acknowledged; pysyncobj's truncation warning: {diverged}"
        )
    finally:
        writer.stop()
        for p in ctl.proc:
            if p is not None:
                p.stop()
        for at in mounts:
            subprocess.run(["umount", "-l", str(at)], capture_output=True, timeout=30)
