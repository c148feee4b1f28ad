"""A role's log lines are written by a thread of their own (adamps/wire/logs.py): writing one
never holds the event loop (issue 39; docs/operations.md, "The event loop").

A controller logs every refused operator request on its loop. Here its stderr is a pipe that
nobody reads for a while (a log collector that lags): once the pipe's buffer is full, a write
waits. Written on the loop (the controller before this change: `logging.basicConfig`'s stream
handler), that wait held the loop until the reader came back, and the controller answered
nothing, /healthz included. Now the controller answers every request meanwhile, and once the
reader is back every line arrives, none lost.
"""

from __future__ import annotations

import shlex
import time

import pytest

from adamps.up.cluster import LocalCluster
from adamps.up.procs import PARENT_ENV
from tests.looplag_probe import request

pytestmark = pytest.mark.slow

TOKEN = "log-token"
#: refused drains, each logged (one line of ~330 bytes): three times a pipe's 64 KiB
N_REQUESTS = 600
#: the refused server's id, long, so that few requests fill the pipe
SID = "s" * 120


@pytest.mark.timeout(300)
def test_a_blocked_log_pipe_does_not_hold_the_event_loop(tmp_path) -> None:
    gate = tmp_path / "read-the-log"

    def wrap(name: str, argv: list[str]) -> list[str]:
        # the role's stderr and stdout: a pipe whose reader waits for `gate` before it reads.
        # The role's parent is the shell, not this process: it must not check for this one
        # (PARENT_ENV); stop() ends the shell, the role and the reader alike (one group).
        reader = f"while [ ! -e {shlex.quote(str(gate))} ]; do sleep 0.05; done; exec cat"
        role = f'env -u {PARENT_ENV} "$@" 2>&1'
        return ["sh", "-c", f"{role} | {{ {reader}; }}", "sh", *argv]

    c = LocalCluster(tmp_path, token=TOKEN, n_controllers=1, n_servers=0, n_buckets=8, wrap=wrap)
    try:
        c.start_controller(0)
        addr = c.controllers[0]
        c.procs["controller0"].wait_http(f"http://{addr}/healthz", timeout=60)
        deadline = time.monotonic() + 30
        while c.controller_leader() is None:
            assert time.monotonic() < deadline, "the controller did not lead within 30 s"
            time.sleep(0.1)
        hdr = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
        t0 = time.monotonic()
        for i in range(N_REQUESTS):
            try:
                code, body = request(addr, "POST", f"/servers/{SID}{i}/drain", b"{}", hdr, 10)
            except TimeoutError:
                pytest.fail(f"request {i} unanswered for 10 s: the log's write holds the loop")
            assert code == 404, (code, body[:300])
        try:
            assert request(addr, "GET", "/healthz", timeout=10)[0] == 200
        except TimeoutError:
            pytest.fail("/healthz unanswered for 10 s: the log's write holds the loop")
        print(f"{N_REQUESTS} refused drains in {time.monotonic() - t0:.1f} s, the log unread")
        gate.touch()
        log = tmp_path / "logs" / "controller0.log"
        deadline = time.monotonic() + 30
        while log.read_text(errors="replace").count(f"/servers/{SID}") < N_REQUESTS:
            assert time.monotonic() < deadline, "log lines lost"
            time.sleep(0.2)
    finally:
        gate.touch()
        c.stop()
