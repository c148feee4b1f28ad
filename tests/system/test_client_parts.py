"""PSClient splits pushes and pulls larger than a server's limits (issue 30), exactly once per
part: real controllers and parameter servers started with a small `max_body` (64 KiB) and
`max_shards_per_request` (4), a tensor of 256 KiB (64 shards over 8 buckets, 8 shards a bucket
on average: more than one request may carry, so buckets are cut into parts with pairs of their
own). Before, the client sent one request per server and got `413 too_large`.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import TOKEN, digests_agree  # noqa: E402

pytestmark = pytest.mark.slow

N = 64_000
SHARD = 1_000
MAX_BODY = 64 << 10
MAX_SHARDS = 4
TENSOR = TensorSpec("x", (N,))


def test_a_tensor_beyond_max_body_is_pushed_and_pulled_in_parts_exactly_once(
    tmp_path: Path,
) -> None:
    c = LocalCluster(
        tmp_path, token=TOKEN, n_servers=3, n_buckets=8, controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": SHARD, "max-body": MAX_BODY,
                 "max-shards-per-request": MAX_SHARDS},
    )  # fmt: skip
    try:
        c.start(timeout=60)
        layout = Layout([TENSOR], n_buckets=8, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=30.0)
        client.create(TENSOR, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        ramp = np.arange(N, dtype=np.float32) % 7  # distinct values per element: no mix-up
        assert ramp.nbytes > 3 * MAX_BODY  # larger than any one server's request may be

        # One push in parts, over the data plane and over HTTP; then the same push again with
        # the same seq (what a caller does after an unknown outcome): every part is dropped.
        for data_plane in (True, False):
            client.data_plane = data_plane
            before = client.dp_requests + client.http_requests
            seq = client.next_seq()
            client.push_dense("x", ramp, seq=seq)
            sent = client.dp_requests + client.http_requests - before
            assert sent >= N // SHARD // MAX_SHARDS, f"{sent} requests: not split"
            client.push_dense("x", ramp, seq=seq)
        values, _ = client.pull(["x"])
        assert np.array_equal(values["x"], 2 * ramp), "a part applied twice or not at all"

        # Under a primary's SIGKILL: parts whose outcome is unknown are retried with their own
        # pairs; every push is acknowledged (the client retries through the failover), and the
        # sum is exact.
        acked = [0]
        errors: list[BaseException] = []

        def pusher() -> None:
            try:
                for _ in range(40):
                    client.push_dense("x", ramp)
                    acked[0] += 1
            except (RpcError, ConnectionError, TimeoutError) as exc:
                errors.append(exc)

        t = threading.Thread(target=pusher)
        t.start()
        time.sleep(1.0)
        view = c.cluster()
        victim = max(c.server_ids, key=lambda s: sum(b["primary"] == s for b in view["buckets"]))
        c.kill(victim)
        t.join(120)
        assert not t.is_alive() and not errors, errors
        assert acked[0] == 40
        values, _ = client.pull(["x"])
        assert np.array_equal(values["x"], 42 * ramp), (
            f"not exact: {np.unique(values['x'] / np.where(ramp == 0, 1, ramp))[:10]}"
        )
        print(f"client retries: {client.retries}")
        digests_agree(c)
        client.close()
    finally:
        c.stop()
