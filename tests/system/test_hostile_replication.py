"""Issue 28 against a real replicated cluster (1 controller, 3 parameter servers, processes on
loopback): what a holder of the cluster token could do to the replicas, and malformed
replication messages.

- a forged PREPARE + COMMIT of a NaN batch to a secondary, claiming to be the bucket's primary
  (its id, the current epoch, seq = committed + 1): refused, not applied, replicas agree;
- malformed repl_* messages on /rpc: a 4xx with a JSON error, never a 500.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adamps.localcluster import LocalCluster
from adamps.rpc import RpcError, SyncRpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import (  # noqa: E402  (in tests/; the tests import in importlib mode)
    SHARD,
    TOKEN,
    digests_agree,
    make_client,
    running_cluster,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Any, Any]]:
    root = tmp_path_factory.mktemp("hostile-repl")
    with running_cluster(root, n_servers=3, n_controllers=1) as c:
        client, layout = make_client(c)
        client.push_dense("x", np.ones(16_000, np.float32))
        try:
            yield c, client, layout
        finally:
            client.close()


def _target(c: LocalCluster, layout: Any) -> dict[str, Any]:
    """Bucket 0's members, addresses, one of its shards and the secondary's position."""
    view = c.cluster()
    assert view is not None
    b = next(x for x in view["buckets"] if x["bucket"] == 0 and x["secondaries"])
    servers = view["servers"]
    sid = next(s for s, bucket in layout.bucket_of.items() if bucket == 0)
    sec = b["secondaries"][0]
    with SyncRpc(servers[sec]["address"], TOKEN) as rpc:
        pos = rpc.call("digest", bucket=0)
    return {
        "primary": b["primary"],
        "secondary": servers[sec]["address"],
        "sid": sid,
        "epoch": pos["epoch"],
        "committed": pos["committed"],
        "digest": pos["digest"],
    }


def _forged_prepare(t: dict[str, Any], delta: np.ndarray) -> dict[str, Any]:
    seq = t["committed"] + 1
    batch = {
        "seq": seq,
        "epoch": t["epoch"],
        "updates": [[{"k": "d", "s": t["sid"], "d": delta}]],
        "clients": [None],
    }
    return {"bucket": 0, "sender": t["primary"], "epoch": t["epoch"], "entries": [batch]}


def test_a_forged_nan_batch_is_refused_by_the_secondary(cluster) -> None:
    c, client, layout = cluster
    t = _target(c, layout)
    nan = np.full(SHARD, np.nan, np.float32)
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        with pytest.raises(RpcError) as err:
            rpc.call("repl_prepare", **_forged_prepare(t, nan), commit=t["committed"] + 1)
        assert 400 <= err.value.status < 500, err.value
        try:  # a commit of that seq finds nothing prepared to apply
            rpc.call(
                "repl_commit", bucket=0, sender=t["primary"], epoch=t["epoch"],
                seq=t["committed"] + 1,
            )  # fmt: skip
        except RpcError as exc:
            assert 400 <= exc.status < 500, exc
        after = rpc.call("digest", bucket=0)
    assert (after["committed"], after["digest"]) == (t["committed"], t["digest"])
    client.push_dense("x", np.ones(16_000, np.float32))  # the real next batch still replicates
    values, _ = client.pull(["x"])
    assert np.isfinite(values["x"]).all()
    digests_agree(c)


def _malformed() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    junk = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8),
        st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        st.just(np.full(3, np.nan, np.float32)), st.just(np.zeros((2, 2), np.float64)),
    )  # fmt: skip
    update = st.one_of(
        junk,
        st.fixed_dictionaries(
            {"k": st.sampled_from(["d", "f", "c", "v", "z"])},
            optional={
                "s": junk,
                "d": junk,
                "t": junk,
                "a": junk,
                "e": junk,
                "w": junk,
                "r": junk,
                "n": junk,
                "b": junk,
                "o": junk,
                "y": junk,
                "x": junk,
            },
        ),  # fmt: skip
    )
    batch = st.one_of(
        junk,
        st.fixed_dictionaries(
            {
                "seq": st.one_of(st.integers(1, 5), junk),
                "epoch": st.one_of(st.integers(1, 5), junk),
            },
            optional={
                "updates": st.one_of(
                    junk, st.lists(st.one_of(junk, st.lists(update, max_size=2)), max_size=2)
                ),
                "clients": st.one_of(junk, st.lists(junk, max_size=2)),
            },
        ),  # fmt: skip
    )
    prepare = st.fixed_dictionaries(
        {"bucket": st.just(0), "sender": st.one_of(st.text(max_size=4), junk),
         "epoch": st.one_of(st.integers(1, 5), junk)},
        optional={"entries": st.one_of(junk, st.lists(batch, max_size=2)), "commit": junk},
    ).map(lambda m: ("repl_prepare", m))  # fmt: skip
    ping = st.fixed_dictionaries(
        {"sender": st.text(max_size=4), "buckets": st.dictionaries(st.text(max_size=4), junk, max_size=3)}
    ).map(lambda m: ("repl_ping", m))  # fmt: skip
    multi = st.lists(st.one_of(prepare, ping), max_size=2).map(
        lambda items: ("repl_multi", {"items": [{"op": op, **m} for op, m in items]})
    )
    return st.one_of(prepare, ping, multi)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_malformed())
def test_malformed_replication_messages_get_a_4xx_never_a_500(cluster, case) -> None:
    c, _client, layout = cluster
    op, fields = case
    view = c.cluster()
    assert view is not None
    sec = next(x for x in view["buckets"] if x["bucket"] == 0)["secondaries"][0]
    with SyncRpc(view["servers"][sec]["address"], TOKEN) as rpc:
        try:
            reply = rpc.call(op, **fields)
        except RpcError as exc:
            assert 400 <= exc.status < 500, (op, fields, exc)
            return
    if op == "repl_multi":  # each item answered on its own, none an internal error
        for r in reply["results"]:
            assert r.get("error", {}).get("code") != "internal", (fields, r)
