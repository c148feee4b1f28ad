"""Pushes over the binary data plane of a replicated cluster, through a primary's SIGKILL.

Reference: Project Adam 3.3.3; docs/protocol-ps.md, "Binary data plane". The data plane's pushes
pass the same write path as /rpc (lease check, two-phase commit, exactly once by (client, seq)),
so the exactness checker's contract holds whichever transport: every acknowledged push present
exactly once, every failed one absent, unknown ones at most once, and every bucket's replicas
identical. The client must actually have used the data plane (and never HTTP) for its pushes
and pulls.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from adamps.exactness import ExactnessLoad
from adamps.rpc import get_text

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import LEASE, digests_agree, make_client, running_cluster  # noqa: E402

pytestmark = pytest.mark.slow


def dp_pushes_ok(address: str) -> float:
    """adamps_ps_requests_total{op="dp_push_dense",outcome="ok"} of one server."""
    for line in get_text(address, "/metrics").splitlines():
        if line.startswith("adamps_ps_requests_total{") and 'op="dp_push_dense"' in line:
            if 'outcome="ok"' in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(180)
def test_dataplane_pushes_survive_a_primary_sigkill_exactly_once(tmp_path: Path) -> None:
    with running_cluster(tmp_path, n_servers=4) as c:
        client, _layout = make_client(c)
        assert client.data_plane
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
        assert sum(dp_pushes_ok(a) for a in survivors) > 0
        digests_agree(c)
        client.close()
