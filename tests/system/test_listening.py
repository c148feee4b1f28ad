"""Issue 12: `ss -ltn` on an `adamps up` cluster shows no port bound beyond the configured
addresses. `adamps up` configures 127.0.0.1 for every role; every listening socket of every
process of the run (controllers' HTTP and Raft ports, parameter servers, data server, trainer)
must be bound to loopback, never to 0.0.0.0 or ::.

Sockets are attributed to processes without psutil: a process's /proc/PID/fd links name socket
inodes, and /proc/net/tcp{,6} lists each listening socket's local address with its inode.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from adamps.up.procs import adamps_argv

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 (as /proc prints)


def socket_inodes(pid: int) -> set[int]:
    out = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def listening_sockets() -> dict[int, tuple[str, int]]:
    """inode -> (hex local address, port) of every TCP socket in LISTEN state."""
    found = {}
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":
                addr, port = f[1].rsplit(":", 1)
                found[int(f[9])] = (addr, int(port, 16))
    return found


def run_processes(run: Path) -> dict[int, str]:
    """Live processes of the run: recorded children, their sessions, or naming the run dir."""
    pids = json.loads((run / "pids.json").read_text())
    children = {pid for name, pid in pids.items() if name != "up"}
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        sid = int(stat.rsplit(")", 1)[1].split()[3])
        pid = int(entry.name)
        if pid in children or sid in children or str(run) in cmd:
            found[pid] = cmd[:160]
    return found


def training(run: Path) -> bool:
    try:
        lines = (run / "progress.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(x)["images_per_s"] > 0 for x in lines if x.endswith("}"))


@pytest.mark.timeout(150)
def test_adamps_up_binds_nothing_beyond_loopback(tmp_path: Path) -> None:
    run = tmp_path / "run"
    out = tmp_path / "up.out"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ADAMPS_TOKEN", None)
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            adamps_argv("up", "--run-dir", str(run), "--no-progress", "--epochs", "200",
                        "--trainers", "1", "--stop-timeout", "5"),
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
            start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not training(run):
            assert proc.poll() is None, out.read_text()
            assert time.monotonic() < deadline, out.read_text()
            time.sleep(0.2)
        procs = run_processes(run)
        listen = listening_sockets()
        bound: list[tuple[str, str, int]] = []
        for pid, cmd in procs.items():
            for inode in socket_inodes(pid):
                if inode in listen:
                    addr, port = listen[inode]
                    bound.append((cmd, addr, port))
        # 3 controllers x (HTTP + Raft) + 3 PS + 1 data server + the trainer's metrics port.
        assert len({port for _, _, port in bound}) >= 11, bound
        beyond = [b for b in bound if b[1] not in LOOPBACK]
        assert not beyond, f"listening beyond loopback: {beyond}"
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
