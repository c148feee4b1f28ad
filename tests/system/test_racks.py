"""Rack-aware placement with real processes (issue 26): 3 controllers and 6 parameter servers
in 3 racks of 2 (`--rack`). A bucket's copies are on 3 distinct racks, so SIGKILLing both
servers of one rack at once leaves every bucket a copy: every bucket is served again by a
survivor, with every acknowledged push, and takes new pushes."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import LocalCluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TOKEN = "test-token"
N_BUCKETS = 12
SHARD = 1_000
TENSOR = TensorSpec("x", (12_000,))  # 12 shards: every bucket holds some of it
RACKS = ["ra", "rb", "rc", "ra", "rb", "rc"]


def test_a_whole_rack_killed_leaves_every_bucket_served_with_every_push(tmp_path: Path) -> None:
    c = LocalCluster(
        tmp_path, token=TOKEN, n_servers=6, n_buckets=N_BUCKETS, racks=RACKS,
        controller_opts={"lease-duration": 1.0, "heartbeat-interval": 0.2, "server-timeout": 1.0,
                         "reconcile-interval": 0.1, "min-servers": 6},
        ps_opts={"member-timeout": 0.5, "ping-interval": 0.2, "failover-after": 1.0,
                 "max-shard-elems": SHARD},
    )  # fmt: skip
    stack = contextlib.ExitStack()
    try:
        c.start(timeout=90)
        rack_of = dict(zip(c.server_ids, RACKS, strict=True))
        view = c.wait_for(lambda v: v["rack_shared"] == 0, "copies on distinct racks", 30)
        assert view["racks"] == 3
        assert {s: r["rack"] for s, r in view["servers"].items()} == rack_of
        for bv in view["buckets"]:
            holders = [bv["primary"], *bv["secondaries"]]
            assert sorted(rack_of[s] for s in holders) == ["ra", "rb", "rc"], bv

        layout = Layout([TENSOR], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=30.0)
        # Closed however the test ends: a client left to the garbage collector fails the next
        # test with its unclosed sockets (CI, session 9: test_rows_failover after this one).
        stack.callback(client.close)
        client.create(TENSOR, init={"kind": "constant", "value": 0.0},
                      optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip
        for _ in range(3):
            client.push_dense("x", np.ones(TENSOR.shape, np.float32))

        dead = [s for s in c.server_ids if rack_of[s] == "ra"]
        for sid in dead:  # the whole rack at once (power, top-of-rack switch)
            c.kill(sid)

        def recovered(v: dict) -> bool:
            return not v["unavailable"] and all(
                bv["primary"] is not None and bv["primary"] not in dead for bv in v["buckets"]
            )

        view = c.wait_for(recovered, "every bucket served by a survivor", 60)
        assert view["unavailable"] == [] and view["lost"] == []
        # Two racks left for three copies: the third copy shares a rack, and /cluster says so.
        assert view["racks"] == 2
        got = client.pull(["x"])[0]["x"]
        np.testing.assert_array_equal(got, np.full(TENSOR.shape, 3.0, np.float32))
        client.push_dense("x", np.ones(TENSOR.shape, np.float32))
        got = client.pull(["x"])[0]["x"]
        np.testing.assert_array_equal(got, np.full(TENSOR.shape, 4.0, np.float32))
    finally:
        stack.close()
        c.stop()
