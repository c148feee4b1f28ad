"""A push split over servers is refused whole, or says which parts were applied (issue 39).

The testers' scenario: ``push_rows`` of two ids whose buckets have different primaries, one row
NaN. The server of the NaN row refused it while the other applied its row, and the caller got a
4xx, which says "nothing applied" (57 of 57 trials). Now the client checks the whole push before
it sends any part: nothing is applied anywhere, and the error names the problem. The same for a
dense push cut by shard, a round (push_fc layers + dense) and compressed updates, in a real
cluster (controllers, two parameter servers, the primaries spread over both).

What validation cannot foresee (a server gone until the retries' deadline) ends in a
``PartialPushError`` naming the buckets applied and those not confirmed; the same push sent again
with its seq completes it exactly once.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PartialPushError, PSClient
from adamps.client.rpc import RpcError
from adamps.layout import Layout, TensorSpec
from adamps.tables import buckets_of
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import TOKEN  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

N_BUCKETS = 8
SHARD = 100
W = TensorSpec("w", (40, 50))  # 20 shards of 2 rows over the 8 buckets
B = TensorSpec("b", (1000,))  # 10 shards
TABLE, DIM = "emb", 4


def ids_on_two_primaries(client: PSClient, n: int = 2) -> np.ndarray:
    """`n` ids whose buckets are led by at least two different servers."""
    routes = client.routing(refresh=True).routes
    by_server: dict[str, int] = {}
    for i in range(1000):
        url = routes[int(buckets_of(np.array([i]), N_BUCKETS)[0])].primary
        by_server.setdefault(url, i)
        if len(by_server) >= 2:
            break
    assert len(by_server) >= 2, "the primaries must be on two servers for this test"
    picked = list(by_server.values())
    return np.array(picked + list(range(2000, 2000 + n - len(picked))), np.int64)


def spans_two_servers(client: PSClient, name: str) -> bool:
    routes = client.routing(refresh=True).routes
    return (
        len({routes[client.layout.bucket_of[s.id]].primary for s in client.layout.shards_of[name]})
        >= 2
    )


def refused_4xx(exc: pytest.ExceptionInfo[RpcError], code: str) -> None:
    assert exc.value.code == code, exc.value
    assert exc.value.http_status is not None and 400 <= exc.value.http_status < 500
    assert "nothing was sent" in str(exc.value)


def test_a_push_with_one_bad_part_is_refused_whole_on_every_server(tmp_path: Path) -> None:
    c = LocalCluster(
        tmp_path, token=TOKEN, n_controllers=1, n_servers=2, n_buckets=N_BUCKETS,
        controller_opts={**FAST_CONTROLLER_OPTS, "replication": 2, "min-servers": 2},
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": SHARD},
    )  # fmt: skip
    try:
        c.start(timeout=90)
        c.wait_placed(60)
        layout = Layout([W, B], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=30.0)
        for spec in (W, B):
            client.create(spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        client.create_table(
            TABLE, DIM, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0}
        )
        assert spans_two_servers(client, "w") and spans_two_servers(client, "b")

        # (a) the testers' scenario: two ids on two primaries, one NaN row
        ids = ids_on_two_primaries(client)
        grads = np.ones((2, DIM), np.float32)
        grads[1, 2] = np.nan
        with pytest.raises(RpcError) as exc:
            client.push_rows(TABLE, ids, grads)
        refused_4xx(exc, "non_finite")
        assert "grads holds 1 NaN/Inf" in str(exc.value)
        # an Inf, a value beyond the servers' bound, a wrong dim: refused whole as well
        for bad, code in ((np.inf, "non_finite"), (1e13, "bad_request")):
            g = np.ones((2, DIM), np.float32)
            g[0, 0] = bad
            with pytest.raises(RpcError) as exc:
                client.push_rows(TABLE, ids, g)
            refused_4xx(exc, code)
        with pytest.raises(RpcError) as exc:
            client.push_rows(TABLE, ids, np.ones((2, DIM + 1), np.float32))
        refused_4xx(exc, "bad_shape")
        np.testing.assert_array_equal(client.pull_rows(TABLE, ids), 0.0, "a row was applied")

        # (b) a dense push cut by shard over both servers, one shard's values NaN
        before, versions = client.pull(["w", "b"])
        w = np.ones(W.shape, np.float32)
        w[-1, -1] = np.nan
        b = np.ones(B.shape, np.float32)
        for push in (
            lambda: client.push_dense_many({"w": w, "b": b}),
            lambda: client.push_shards({s.id: w.reshape(-1)[s.start : s.stop]
                                        for s in layout.shards_of["w"]}),  # fmt: skip
            # a round: the fc layer's vectors are good, the dense part is not
            lambda: client.push_round({"w": (np.ones((3, 50), np.float32),
                                             np.ones((3, 40), np.float32))},
                                      {"b": np.where(np.arange(1000) == 999, np.nan, 1.0)}),
            # compressed updates: one shard's tau is NaN
            lambda: client.push_compressed({
                layout.shards_of["b"][0].id: {"tau": 1.0, "words": np.array([0], np.uint32)},
                layout.shards_of["b"][-1].id: {"tau": float("nan"),
                                               "words": np.array([0], np.uint32)},
            }),
        ):  # fmt: skip
            with pytest.raises(RpcError) as exc:
                push()
            refused_4xx(exc, "non_finite")
        # a wrong shape and an unknown shard are refused before sending too
        with pytest.raises(RpcError) as exc:
            client.push_dense_many({"b": b, "w": np.ones((40, 49), np.float32)})
        refused_4xx(exc, "bad_shape")
        with pytest.raises(RpcError) as exc:
            client.push_shards({layout.shards_of["b"][0].id: b[:100], "nope/0": b[:100]})
        refused_4xx(exc, "unknown_tensor")
        after, after_versions = client.pull(["w", "b"])
        for name in ("w", "b"):
            np.testing.assert_array_equal(after[name], before[name], f"{name} changed")
            assert after_versions[name] == versions[name], f"{name}: a shard applied a push"

        # the same pushes, good, are applied whole: the checks refuse nothing valid
        client.push_rows(TABLE, ids, np.ones((2, DIM), np.float32))
        client.push_dense_many({"w": np.ones(W.shape, np.float32), "b": b})
        np.testing.assert_array_equal(client.pull_rows(TABLE, ids), 1.0)
        got, _ = client.pull(["w", "b"])
        np.testing.assert_array_equal(got["w"], 1.0)
        np.testing.assert_array_equal(got["b"], 1.0)
        client.close()
    finally:
        c.stop()


def test_a_part_refused_for_availability_is_reported_and_completed_by_its_seq(
    tmp_path: Path,
) -> None:
    """Two servers, one copy of each bucket (replication 1: a dead server's buckets have no other
    copy, so none fails over within the client's retries). One server is SIGKILLed; a push over
    both: the live server applies its part, the other's buckets stay unavailable until the
    retries' deadline. The error says which buckets were applied where; once the server is
    back, the same push with the same seq applies the missing part and drops the applied one
    (exactly once, the replicated servers' (client, seq))."""
    c = LocalCluster(
        tmp_path, token=TOKEN, n_controllers=1, n_servers=2, n_buckets=N_BUCKETS,
        controller_opts={**FAST_CONTROLLER_OPTS, "replication": 1, "min-servers": 2},
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": SHARD},
    )  # fmt: skip
    try:
        c.start(timeout=90)
        layout = Layout([B], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=2.0)
        client.create(B, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        client.create_table(
            TABLE, DIM, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0}
        )
        routes = client.routing(refresh=True).routes
        ids = np.arange(16, dtype=np.int64)
        on = {b: routes[b].primary for b in buckets_of(ids, N_BUCKETS).tolist()}
        dense_on = {layout.bucket_of[s.id]: routes[layout.bucket_of[s.id]].primary
                    for s in layout.shards_of["b"]}  # fmt: skip
        urls = sorted(set(on.values()))
        assert len(urls) == 2 and set(dense_on.values()) == set(urls), "must span both servers"
        # Clients that have been pushing: they know both servers' limits and data ports, and
        # a routing table from before the failure (each push below starts from one, as the
        # first push after a failure does: a client that already knows the buckets unavailable
        # sends no part at all, and its error is the whole push's)
        rows_client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=2.0)
        rows_client.tables[TABLE] = DIM
        rows_client.push_rows(TABLE, ids, np.zeros((16, DIM), np.float32))
        client.push_dense("b", np.zeros(B.shape, np.float32))
        time.sleep(1.0)  # flushed (flush-interval 0.5 s): the restart finds the tensors
        victim = c.server_of(urls[1].removeprefix("http://"))
        c.kill(victim)

        seq_rows, seq_dense = client.next_seq(), client.next_seq()
        ones_rows, ones = np.ones((16, DIM), np.float32), np.ones(B.shape, np.float32)
        for push, where in (
            (lambda: rows_client.push_rows(TABLE, ids, ones_rows, seq=seq_rows), on),
            (lambda: client.push_dense("b", ones, seq=seq_dense), dense_on),
        ):
            with pytest.raises(PartialPushError) as exc:
                push()
            err = exc.value
            assert err.applied == {b: u for b, u in where.items() if u == urls[0]}, err
            assert err.unconfirmed == {b: u for b, u in where.items() if u == urls[1]}, err
            assert err.applied_servers == {urls[0]} and err.unconfirmed_servers == {urls[1]}
            assert err.seq in (seq_rows, seq_dense)
            assert "applied in part" in str(err) and f"seq={err.seq}" in str(err)
            print(f"{err.op}: {err.code}: {err}")

        # The live server's parts are applied, once
        live = ids[[on[b] == urls[0] for b in buckets_of(ids, N_BUCKETS).tolist()]]
        np.testing.assert_array_equal(client.pull_rows(TABLE, live), 1.0)

        # Back, then the same pushes with their seqs: the missing parts applied, the others
        # dropped
        c.restart_server(c.index_of(victim))
        client.retry_for = rows_client.retry_for = 60.0
        rows_client.push_rows(TABLE, ids, ones_rows, seq=seq_rows)
        client.push_dense("b", ones, seq=seq_dense)
        np.testing.assert_array_equal(client.pull_rows(TABLE, ids), 1.0, "a part applied twice")
        got, _ = client.pull(["b"])
        np.testing.assert_array_equal(got["b"], 1.0, "a part applied twice")
        client.close()
        rows_client.close()
    finally:
        c.stop()
