"""Issue 39, finding 1, on a real cluster: a run deleted while it pushes.

3 controllers (Raft), 3 parameter servers (replicated buckets, LMDB), `adamps run delete` as a
process. One bucket, so run F's tensors and table and the operator's tensor share it. F pushes
every update kind (dense over the data plane and over HTTP, push_fc's activation and error
vectors, compressed signs, embedding rows, vector operations) from its own threads while the
operator deletes it. Before, the primary's drain raised StoreError("no shard 'F..w/0' on this
server") and the bucket took no push again, from any tenant. Now:

- F's pushes in flight are refused alone (unknown_tensor, unknown_table; then 401 once the
  token is gone), none waits out the push timeout;
- the operator's own tensor in the same bucket takes pushes at once, and its pull is exact;
- every copy of the bucket ends with the same digest, and no server logged a task exception.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.compression import codec
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster
from tests.polling import wait_for
from tests.replicated_cluster import TOKEN, digests_agree
from tests.system.test_runs import adamps_run, create_run

pytestmark = pytest.mark.slow

SGD = {"kind": "sgd", "lr": -1.0}  # a push of d adds d
OP = TensorSpec("op", (64,))
W = TensorSpec("F..w", (8, 6))
WV = TensorSpec("F..w@v", (8, 6))


def pushers(c: LocalCluster, token: str) -> tuple[dict[str, Callable[[], None]], list[PSClient]]:
    """One push of each kind of run F, each kind with a client of its own (closed by the
    caller)."""
    routing = ControllerRouting(c.controllers)

    def client(dp: bool) -> PSClient:
        return PSClient(
            routing, Layout([W, WV], 1), token, retry_for=3.0, timeout=8.0, data_plane=dp
        )

    dense_dp, dense_http, fc, comp, rows, vec = (client(k == 0) for k in range(6))
    words = codec.pack_words(np.array([1, 7]), np.array([False, True]))
    sid = W.name + "/0"

    def vec_op() -> None:
        primary = vec.routing().routes[0].primary.split("://", 1)[-1]
        with SyncRpc(primary, token, timeout=8.0) as rpc:
            rpc.call("vec", kind="axpy", shards=[sid], y="v", x="", alpha=0.5,
                     client=vec.client_id, seq=vec.next_seq())  # fmt: skip

    clients = [dense_dp, dense_http, fc, comp, rows, vec]
    return {
        "dense_dp": lambda: dense_dp.push_dense(W.name, np.ones(W.shape, np.float32)),
        "dense_http": lambda: dense_http.push_dense(W.name, np.ones(W.shape, np.float32)),
        "fc": lambda: fc.push_fc(W.name, np.ones((2, 6), np.float32), np.ones((2, 8), np.float32)),
        "compressed": lambda: comp.push_compressed({sid: {"tau": 0.25, "words": words}}),
        "rows": lambda: rows.push_rows("F..t", np.arange(5), np.ones((5, 4), np.float32)),
        "vec": vec_op,
    }, clients


@pytest.mark.timeout(300)
def test_a_run_deleted_while_it_pushes_leaves_its_bucket_to_the_others(tmp_path: Path) -> None:
    c = LocalCluster(
        tmp_path / "cluster",
        token=TOKEN,
        n_servers=3,
        n_buckets=1,
        controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts={**FAST_PS_OPTS, "push-timeout": 10.0},
    )
    c.start(timeout=60)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    try:
        # The operator's tensor, pushed once before.
        op = PSClient(
            ControllerRouting(c.controllers), Layout([OP], 1), TOKEN, retry_for=8.0, timeout=8.0
        )
        op.create(OP, init={"kind": "zeros"}, optimizer=SGD)
        op.push_dense(OP.name, np.ones(64, np.float32))

        tf = create_run(c, "F", tmp_path)
        f = PSClient(ControllerRouting(c.controllers), Layout([W, WV], 1), tf, retry_for=10.0)
        f.create(W, init={"kind": "zeros"}, optimizer=SGD)
        f.create(WV, init={"kind": "zeros"}, optimizer=SGD)
        f.create_table("F..t", 4, optimizer=SGD)
        f.close()

        outcomes: Counter[tuple[str, str]] = Counter()
        lock = threading.Lock()

        def run(kind: str, push: Callable[[], None]) -> None:
            while not stop.is_set():
                try:
                    push()
                    what = "ok"
                except RpcError as exc:
                    what = exc.code
                except Exception as exc:  # a push that could not be confirmed, a connection
                    what = type(exc).__name__
                with lock:
                    outcomes[(kind, what)] += 1
                if what != "ok":
                    time.sleep(0.05)

        pushes, f_clients = pushers(c, tf)
        for kind, push in pushes.items():
            threads.append(threading.Thread(target=run, args=(kind, push), daemon=True))
            threads[-1].start()
        kinds = ("dense_dp", "dense_http", "fc", "compressed", "rows", "vec")
        wait_for(lambda: all(outcomes[(k, "ok")] >= 5 for k in kinds), 60, f"F pushes: {outcomes}")

        # Delete run F while its pushes are in flight.
        out = adamps_run(c, "delete", "F")
        assert out.returncode == 0, out.stderr
        for addr in c.servers:
            wait_for(
                lambda addr=addr: (
                    "F..w"
                    not in json.loads(urllib.request.urlopen(f"http://{addr}/status").read())[
                        "tensors"
                    ]
                ),
                20,
                f"{addr} drops run F's tensors",
            )
        time.sleep(1.0)  # F's threads go on (their token is refused now)
        stop.set()
        for t in threads:
            t.join(timeout=20)
        assert not any(t.is_alive() for t in threads)
        for fc in f_clients:
            fc.close()
        print("run F's pushes:", dict(outcomes))
        # F's pushes in flight were refused or applied, none waited out the push timeout.
        stuck = ("timeout", "TimeoutError")  # the wedge's outcomes
        assert not [k for k in outcomes if k[1] in stuck], outcomes

        # The operator's tensor in the same bucket takes pushes at once; its pull is exact.
        for _ in range(20):
            t0 = time.monotonic()
            op.push_dense(OP.name, np.ones(64, np.float32))
            assert time.monotonic() - t0 < 8.0
        got = op.pull([OP.name])[0][OP.name]
        np.testing.assert_array_equal(got, np.full(64, 21.0, np.float32))
        op.close()

        digests_agree(c)  # every copy of the bucket holds the same values
    finally:
        stop.set()
        c.stop()
    logs = "".join((tmp_path / "cluster" / "logs" / f"{s}.log").read_text() for s in c.server_ids)
    assert "run F was deleted" in logs
    assert "Task exception was never retrieved" not in logs
    assert "cannot be applied" not in logs and "applying a committed batch failed" not in logs
