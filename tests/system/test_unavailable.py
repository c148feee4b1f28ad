"""A bucket whose every copy is gone answers "unavailable", never older values or init, until an
operator declares it lost (issue 11). Real processes: 3 controllers, 3 parameter servers."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import LocalCluster, http_json

pytestmark = pytest.mark.slow

TOKEN = "test-token"
N_BUCKETS = 4
TENSOR = TensorSpec("x", (4_000,))
SHARD = 1_000


def test_wiped_cluster_serves_nothing_until_declared_lost(tmp_path: Path) -> None:
    c = LocalCluster(
        tmp_path, token=TOKEN, n_servers=3, n_buckets=N_BUCKETS,
        controller_opts={"lease-duration": 1.0, "heartbeat-interval": 0.2, "server-timeout": 1.0,
                         "reconcile-interval": 0.1},
        ps_opts={"member-timeout": 0.5, "ping-interval": 0.2, "failover-after": 1.0,
                 "max-shard-elems": SHARD},
    )  # fmt: skip
    try:
        c.start(timeout=60)
        layout = Layout([TENSOR], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=10.0)
        client.create(TENSOR, init={"kind": "constant", "value": 0.0},
                      optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip
        client.push_dense("x", np.ones(TENSOR.shape, np.float32))
        for sid in c.server_ids:
            c.kill(sid)
        for i in range(3):
            c.start_server(i, wipe=True)  # every copy is gone
        for sid, addr in zip(c.server_ids, c.servers, strict=True):
            c.procs[sid].wait_http(f"http://{addr}/healthz", 30)
        unavailable = c.wait_for(
            lambda v: len(v["unavailable"]) == N_BUCKETS, "all unavailable", 30
        )["unavailable"]
        assert unavailable == list(range(N_BUCKETS))

        # The routing table and every server say so; nothing is served from init.
        client.retry_for = 1.0
        with pytest.raises(RpcError) as err:
            client.pull(["x"])
        assert err.value.code == "bucket_unavailable"
        with pytest.raises(RpcError) as err:
            client.push_dense("x", np.ones(TENSOR.shape, np.float32))
        assert err.value.code == "bucket_unavailable"
        for addr in c.servers:
            with SyncRpc(addr, TOKEN, timeout=2.0) as rpc:
                with pytest.raises(RpcError) as err:
                    rpc.call("pull", shards=["x/0"])
                assert err.value.code == "bucket_unavailable" and err.value.http_status == 503

        # Only the operator's explicit command gives the data up: logged, counted, flagged.
        ctl = f"http://{c.controllers[0]}"
        assert http_json(f"{ctl}/buckets/0/declare-lost", "POST", {}, token=None)[0] == 401
        deadline = time.monotonic() + 20
        for b in range(N_BUCKETS):
            while True:
                status, body = http_json(f"{ctl}/buckets/{b}/declare-lost", "POST", {}, TOKEN)
                if status == 200 or time.monotonic() > deadline:
                    break
                assert body["error"]["code"] in ("conflict", "no_quorum"), body
                time.sleep(0.3)
            assert status == 200, body
        view = c.wait_for(lambda v: not v["unavailable"], "served again", 20)
        assert view["lost"] == list(range(N_BUCKETS)) and view["declared_lost"] == N_BUCKETS
        client.retry_for = 20.0
        client.create(TENSOR, init={"kind": "constant", "value": 0.0},
                      optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip
        values, _ = client.pull(["x"])
        assert np.all(values["x"] == 0.0), "declared lost: back to the initial values"
        logs = "".join((tmp_path / "logs" / f"controller{i}.log").read_text() for i in range(3))
        assert "declared LOST by an operator" in logs
        client.close()
    finally:
        c.stop()
