"""Pushes over the binary data plane of a replicated cluster, through a primary's SIGKILL.

Reference: Project Adam 3.3.3; docs/protocol-ps.md, "Binary data plane". The data plane's pushes
pass the same write path as /rpc (lease check, two-phase commit, exactly once by (client, seq)),
so the exactness checker's contract holds whichever transport: every acknowledged push present
exactly once, every failed one absent, unknown ones at most once, and every bucket's replicas
identical. The client must actually have used the data plane (and never HTTP) for its pushes
and pulls.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.client.dataplane import ERROR, REPLY, REQUEST, frame_header
from adamps.client.rpc import get_json, get_text
from adamps.testing.exactness import ExactnessLoad
from adamps.wire import protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frames import read_frame  # noqa: E402
from replicated_cluster import (  # noqa: E402
    LEASE,
    TENSOR,
    TOKEN,
    digests_agree,
    make_client,
    running_cluster,
    signed_frame,
)

pytestmark = pytest.mark.slow


def dp_ok(address: str, op: str = "dp_push_dense") -> float:
    """adamps_ps_requests_total{op=<op>,outcome="ok"} of one server."""
    for line in get_text(address, "/metrics").splitlines():
        if line.startswith("adamps_ps_requests_total{") and f'op="{op}"' in line:
            if 'outcome="ok"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(180)
def test_dataplane_pushes_survive_a_primary_sigkill_exactly_once(tmp_path: Path) -> None:
    # With mutual TLS (issue 28): every port of every process, the clients' and the peers'
    # data-plane connections (repl_multi) included, each side presenting a certificate of the
    # CA this test generates. Only this variant: the same fault over the data plane without TLS
    # is tests/system/test_failover.py's sigkill test (the clients use the data plane there).
    with running_cluster(tmp_path, n_servers=4, tls=True, tls_mutual=True) as c:
        client, _layout = make_client(c)
        assert client.data_plane
        assert get_json(c.servers[0], "/healthz") is not None
        load = ExactnessLoad(client, _layout, "x", threads=4)
        load.start()
        time.sleep(1.5)
        view = c.cluster()
        assert view is not None
        victim = max(
            c.server_ids, key=lambda s: sum(1 for b in view["buckets"] if b["primary"] == s)
        )
        c.kill(victim)
        time.sleep(2 * LEASE + 3)
        load.stop()
        values, _ = client.pull(["x"])
        counts = load.check(values["x"])
        print(
            f"outcomes: {counts}; victim {victim}; dp {client.dp_requests}, http {client.http_requests}"
        )
        assert counts["acked"] > 50
        assert client.http_requests == 0 and client.dp_requests >= counts["acked"]
        survivors = [a for s, a in zip(c.server_ids, c.servers, strict=True) if s != victim]
        assert sum(dp_ok(a) for a in survivors) > 0
        # The rounds' messages between servers went over the data plane too (repl_multi).
        assert sum(dp_ok(a, "dp_repl_multi") for a in survivors) > 0
        digests_agree(c)
        client.close()


def _exchange(s: socket.socket, frame: bytes) -> tuple[int, dict[str, Any]]:
    s.sendall(frame)
    return read_frame(s)


def _repl_frame(items: list[Any], token: str = TOKEN, payload: bytes = b"") -> bytes:
    meta = protocol.encode(protocol.request("repl_multi", token=token, items=items))
    return frame_header(REQUEST, len(meta), len(payload)) + meta + payload


@pytest.mark.timeout(120)
def test_hostile_replication_frames_on_the_data_port_change_nothing(tmp_path: Path) -> None:
    """A server's data port takes its peers' repl_multi: a frame without the cluster token, one
    whose out-of-band array overruns its payload, and a message of an epoch the server never
    learned are refused; the copies stay identical and pushes go on."""
    with running_cluster(tmp_path, n_servers=3) as c:
        client, _layout = make_client(c)
        n = TENSOR.size
        client.push_dense("x", np.ones(n, np.float32))
        address = c.servers[0]
        port = get_json(address, "/status")["data_port"]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            kind, reply = _exchange(s, _repl_frame([], token="guess"))
            assert kind == ERROR and reply["error"]["code"] == "unauthorized"
        me, peer = c.server_ids[0], c.server_ids[1]
        overrun = [{"op": "repl_ping", "sender": peer, "buckets": {},
                    "a": {"dtype": "float32", "shape": [16], "at": 0}}]  # fmt: skip
        stale = [{"op": "repl_commit", "bucket": 0, "epoch": 10**6, "sender": peer, "seq": 1}]
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            kind, reply = _exchange(s, signed_frame(c, peer, me, overrun, payload=bytes(8)))
            # an array past the payload: its segments are unknown, so the frame is unproven
            assert kind == ERROR and reply["error"]["code"] == "forbidden", reply
            assert "cannot be verified" in reply["error"]["message"], reply
            kind, reply = _exchange(s, signed_frame(c, peer, me, stale))  # still usable
            assert kind == REPLY and reply["results"][0]["error"]["code"] == "unavailable", reply
            # the same frame with the cluster token only (no peer's MAC): refused
            kind, reply = _exchange(s, _repl_frame(stale))
            assert kind == ERROR and reply["error"]["code"] == "forbidden", reply
        client.push_dense("x", np.ones(n, np.float32))
        values, _ = client.pull(["x"])
        assert np.array_equal(values["x"], np.full(n, 2, np.float32))
        digests_agree(c)
        client.close()
