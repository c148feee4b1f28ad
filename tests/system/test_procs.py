"""adamps.up.procs: a child started with Proc ends when its parent dies, even by SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from adamps.up.procs import free_port

pytestmark = pytest.mark.slow

PARENT = """
import sys, time
from adamps.up.procs import Proc, adamps_argv, free_port
port = free_port()
p = Proc(adamps_argv("ps", "--port", str(port), "--data-dir", sys.argv[1]), sys.argv[2])
p.wait_http(f"http://127.0.0.1:{port}/healthz")
print(p.pid, flush=True)
time.sleep(120)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (reaped by init eventually).
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_children_die_with_a_sigkilled_parent(tmp_path) -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path / "ps"), str(tmp_path / "ps.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 15
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child), "the child outlived its SIGKILLed parent"
    finally:
        parent.kill()
        parent.stdout.close()


def test_free_port_never_hands_out_a_port_twice() -> None:
    """A cluster takes all its ports before it starts any process: each must be distinct (CI
    once gave a controller's Raft port to a parameter server's HTTP port)."""
    ports = [free_port() for _ in range(2000)]
    assert len(set(ports)) == len(ports)
