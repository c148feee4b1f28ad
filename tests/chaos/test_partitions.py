"""Network partitions, not only signals (issue 11): every controller and parameter server in its
own network namespace on a bridge (tests/chaos/netns.py), links cut silently with nftables.

Reference: Project Adam 3.3.3 (leases make a primary that lost the controllers stop writing before
another copy is promoted). Each test runs the exactness checker under load: every acknowledged
push present exactly once, every failed push absent, unknown ones at most once, and every copy
of every bucket identical at the end.
"""

from __future__ import annotations

import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.controller import ControllerClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.core.lease import LeaseTerms, check_history
from adamps.layout import Layout, TensorSpec
from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import (
    FAST_LEASE,
    LocalCluster,
    http_json,
)
from adamps.wire import protocol

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import netns  # noqa: E402  (a helper beside this file; the tests import in importlib mode)
from replicated_cluster import N_BUCKETS, SHARD, TENSOR, TOKEN, running_cluster  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(netns.available() is not None, reason=str(netns.available())),
]

LEASE = FAST_LEASE
PROBE = TensorSpec("y", (8_000,))  # pushed directly to one primary by the first test


def short(name: str) -> str:
    """Process name -> host name: controller0 -> c0, ps0 -> p0."""
    return ("c" if name.startswith("controller") else "p") + name.removeprefix(
        "controller"
    ).removeprefix("ps")


@pytest.fixture
def net() -> Iterator[netns.Net]:
    n = netns.Net()
    try:
        for i in range(3):
            n.add_host(f"c{i}")
            n.add_host(f"p{i}")
        yield n
    finally:
        n.close()


@pytest.fixture
def cluster(tmp_path: Path, net: netns.Net) -> Iterator[LocalCluster]:
    with running_cluster(
        tmp_path,
        n_servers=3,
        host_of=lambda name: net.hosts[short(name)],
        wrap=lambda name, argv: net.argv(short(name), argv),
    ) as c:
        yield c


def load_on(c: LocalCluster) -> tuple[PSClient, ExactnessLoad]:
    layout = Layout([TENSOR, PROBE], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=30.0)
    for t in (TENSOR, PROBE):
        client.create(t, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    load = ExactnessLoad(client, layout, "x", threads=4, retry_for=30.0)
    load.start()
    return client, load


def finish(c: LocalCluster, client: PSClient, load: ExactnessLoad) -> dict:
    """Stops the load, checks exactness and that every copy of every bucket is identical."""
    load.stop()
    values, _ = client.pull(["x"])
    counts = load.check(values["x"])
    assert counts["acked"] > 50, counts
    copies_agree(c)
    terms = LeaseTerms(**c.cluster()["lease_terms"])
    _, leases = http_json(f"http://{c.controllers[0]}/leases")
    assert check_history(leases["records"], terms) == []
    client.close()
    print(f"outcomes: {counts}")
    return counts


def copies_agree(c: LocalCluster, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        view = c.cluster()
        if view and view["under_replicated"] == 0 and not view["unavailable"]:
            last = []
            for b in view["buckets"]:
                answers = set()
                for sid in [b["primary"], *b["secondaries"]]:
                    try:
                        with SyncRpc(view["servers"][sid]["address"], TOKEN, timeout=2.0) as rpc:
                            d = rpc.call("digest", bucket=b["bucket"])
                        answers.add((d["digest"], d["committed"]))
                    except (RpcError, ConnectionError, TimeoutError) as exc:
                        answers.add(("error", str(exc)))
                last.append((b["bucket"], answers))
            if all(len(a) == 1 for _, a in last):
                return
        time.sleep(0.3)
    raise AssertionError(f"copies differ or the cluster did not settle: {last}")


def primary_of(c: LocalCluster, bucket: int) -> tuple[str, int]:
    view = c.cluster()
    bv = view["buckets"][bucket]
    return bv["primary"], bv["epoch"]


def test_primary_cut_from_controllers_stops_acknowledging_before_a_new_primary(
    cluster: LocalCluster, net: netns.Net
) -> None:
    """The primary of a bucket loses the controllers but not its clients: its lease runs out on
    its own clock, so its last acknowledgement comes before the controllers grant the next
    lease of that bucket to another copy."""
    c = cluster
    client, load = load_on(c)
    layout = client.layout
    sid = "y/0"
    bucket = layout.bucket_of[sid]
    victim, epoch = primary_of(c, bucket)
    host = short(victim)
    addr = c.servers[c.server_ids.index(victim)]
    time.sleep(1.0)
    for i in range(3):
        net.cut(host, f"c{i}")
    cut_at = time.time()
    shard = layout.shards[sid]
    last_ack, refused, i = None, None, 0
    with SyncRpc(addr, TOKEN, timeout=2.0) as rpc:
        while time.time() < cut_at + 4 * LEASE:
            delta = np.zeros(shard.shape, np.float32)
            delta.reshape(-1)[i % shard.size] = 1.0
            try:
                rpc.call("push_dense", shards={sid: delta}, client="direct", seq=i)
                last_ack = time.time()
            except RpcError as exc:
                refused = (exc.code, time.time())
                if exc.code in ("not_primary", "bucket_unavailable"):
                    break
            except (ConnectionError, TimeoutError):
                pass
            i += 1
    assert refused is not None, "the cut-off primary kept acknowledging"
    view = c.wait_for(
        lambda v: v["buckets"][bucket]["epoch"] > epoch and v["buckets"][bucket]["primary"],
        "a new primary", 30,
    )  # fmt: skip
    granted_at = view["buckets"][bucket]["lease"]["granted_at"]
    assert view["buckets"][bucket]["primary"] != victim
    assert last_ack is not None and last_ack < granted_at, (last_ack, granted_at, refused)
    print(f"last ack {last_ack - cut_at:.2f}s after the cut, new lease {granted_at - cut_at:.2f}s")
    net.heal_all()
    finish(c, client, load)


def test_isolated_secondary_is_dropped_then_rejoins(cluster: LocalCluster, net: netns.Net) -> None:
    c = cluster
    client, load = load_on(c)
    time.sleep(1.0)
    view = c.cluster()
    victim = next(s for s in c.server_ids if any(s in b["secondaries"] for b in view["buckets"]))
    net.isolate(short(victim))
    time.sleep(4.0)
    net.heal_all()
    c.wait_for(lambda v: v["under_replicated"] == 0, "the copies back", 30)
    time.sleep(1.0)
    finish(c, client, load)


def test_controller_leader_in_a_minority(cluster: LocalCluster, net: netns.Net) -> None:
    c = cluster
    client, load = load_on(c)
    time.sleep(1.0)
    leader = c.controller_leader()
    assert leader is not None
    for i in range(3):
        if i != leader:
            net.cut(f"c{leader}", f"c{i}")
    time.sleep(5.0)
    # The majority elected another leader; the cut-off one stepped down.
    roles = {
        i: http_json(f"http://{a}/status")[1]["raft"]["role"] for i, a in enumerate(c.controllers)
    }
    assert roles[leader] != "leader" and "leader" in roles.values(), roles
    net.heal_all()
    time.sleep(2.0)
    finish(c, client, load)


def get_at(url: str, index: int | str) -> tuple[int, dict]:
    """GET `url` asking for a state that applied the Raft log up to `index`."""
    req = urllib.request.Request(url, headers={protocol.MIN_APPLIED_HEADER: str(index)})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_client_reads_its_own_writes_through_a_follower_cut_from_the_leader(
    cluster: LocalCluster, net: netns.Net
) -> None:
    """A follower cut from the other controllers still answers reads from its own (stale)
    state. A client that wrote through the leader and whose calls then move to that follower (a
    timeout, a leader change) must still read its own write: its reads name the log index of
    its writes, which the follower has not applied, so it answers 503 and the client asks
    another controller (the session's CI once read 6 of 7 progress reports after a leader
    change, tests/system/test_controller_raft.py)."""
    c = cluster
    leader = c.controller_leader()
    assert leader is not None
    follower = next(i for i in range(3) if i != leader)
    for i in range(3):
        if i != follower:
            net.cut(f"c{follower}", f"c{i}")
    client = ControllerClient(c.controllers, TOKEN, timeout=5.0, retry_for=10.0)
    try:
        client.ring.first = leader
        written = client.report_progress(7, "mine", 0.5)
        assert written["ok"] and client.ring.first == leader, written
        index = written["applied_index"]
        # The cut-off follower answers from its own state, without the write.
        stale = f"http://{c.controllers[follower]}/progress?epoch=7"
        assert "mine" not in http_json(stale)[1]["replicas"]
        # The client's calls moved to it: it is not answered from there.
        client.ring.first = follower
        t0 = time.monotonic()
        assert client.progress(7)["replicas"]["mine"]["progress"] == 0.5
        assert client.ring.first != follower and time.monotonic() - t0 < 5.0
        code, body = get_at(stale, index)
        assert code == 503 and body["error"]["code"] == "unavailable", body
        code, body = get_at(stale, "x1")
        assert code == 400 and protocol.MIN_APPLIED_HEADER in body["error"]["message"], body
        # Healed, the follower applies the log and answers the same read.
        net.heal_all()
        deadline = time.monotonic() + 15
        while True:
            code, body = get_at(stale, index)
            if code == 200:
                break
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
        assert body["replicas"]["mine"]["progress"] == 0.5
    finally:
        client.close()


def test_client_cut_from_the_primary_mid_push(cluster: LocalCluster, net: netns.Net) -> None:
    c = cluster
    client, load = load_on(c)
    time.sleep(1.0)
    victim, _ = primary_of(c, 0)
    net.cut("client", short(victim))
    time.sleep(3.0)
    net.heal_all()
    time.sleep(3.0)
    counts = finish(c, client, load)
    assert counts["acked"] > 0


def test_two_nets_at_once_get_two_subnets() -> None:
    """Two runs at once (pytest-xdist's workers) whose pids are 250 apart started at the same
    /24: both client ends in the root namespace on one subnet, so one run's packets could take
    the other's bridge. Two Nets of one process (the same pid, the same start) stand for them."""
    a = netns.Net()
    try:
        b = netns.Net(tag=f"{a.tag}b")
        try:
            assert a.subnet != b.subnet
            for n in (a, b):  # each run's host is reached through that run's own bridge
                route = netns._ip("-o", "route", "get", n.add_host("h")).stdout
                assert f" dev {n.tag}client"[:20] in route, (n.subnet, route)
        finally:
            b.close()
    finally:
        a.close()
