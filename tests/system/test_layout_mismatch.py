"""A parameter server started with another `n_buckets` than the controllers' stops with one
message naming both and exit status 2 (issue 39, finding 18; issue 40: the reason was logged
twice, once as it stopped and again by `adamps ps` on its way out). Before, the controllers registered it, then the server found
the mismatch in their reply and raised, and its shell took the error for a lost connection:
it registered again forever, a live server the controllers placed buckets on.

Real processes: one controller (`adamps controller --n-buckets 64`) and `adamps ps --n-buckets
32` against it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from adamps.client.controller import ControllerClient, LayoutMismatch
from adamps.up.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_server_of_another_n_buckets_exits_with_a_message_and_is_never_registered(
    tmp_path: Path,
) -> None:
    c = LocalCluster(tmp_path, token="t-layout", n_controllers=1, n_servers=1, n_buckets=64,
                     peer_token="", controller_opts={"min-servers": 1})  # fmt: skip
    try:
        c.start_controller(0)
        c.procs["controller0"].wait_http(f"http://{c.controllers[0]}/healthz", 60)
        c.n_buckets = 32  # what `adamps ps --n-buckets 32` is started with
        proc = c.start_server(0)
        deadline = time.monotonic() + 60
        while proc.alive and time.monotonic() < deadline:
            time.sleep(0.2)
        log = proc.log_path.read_text(errors="replace")
        assert not proc.alive, f"still running (retrying forever?):\n{proc.tail()}"
        assert proc.returncode == 2, (proc.returncode, log[-2000:])  # a configuration error
        # One clear message naming both values and the cure, logged once: no retry loop
        reason = [line for line in log.splitlines() if "n_buckets=32" in line]
        assert len(reason) == 1, reason
        assert "n_buckets=64" in reason[0] and "--n-buckets 64" in reason[0], reason
        assert "registered as" not in log, log[-2000:]
        view = c.cluster()
        assert view is not None and "ps0" not in view["servers"], view["servers"]
        # The controllers refuse such a registration before proposing it; the client names it.
        ctl = ControllerClient(c.controllers, "t-layout", retry_for=2.0)
        try:
            with pytest.raises(LayoutMismatch, match="n_buckets=16.*n_buckets=64"):
                ctl.register("ps9", "127.0.0.1:1", n_buckets=16)
            assert ctl.register("ps9", "127.0.0.1:1", n_buckets=64)["ok"]
        finally:
            ctl.close()
        view = c.cluster()
        assert view is not None and list(view["servers"]) == ["ps9"]
    finally:
        c.stop()
