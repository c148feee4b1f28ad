"""Replication and failover with real processes: 3 controllers and 4 parameter servers on loopback.

Reference: Project Adam 3.3.3. Every test runs the exactness checker (tests/system/exactness.py)
under load, injects a fault, and checks at the end: every acknowledged push present exactly once,
every failed push absent, unknown ones at most once, and the replicas of every bucket identical.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import Layout, TensorSpec
from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import (  # noqa: E402  (in tests/; the tests import in importlib mode)
    LEASE,
    N_BUCKETS,
    SHARD,
    TENSOR,
    TOKEN,
    digests_agree,
    make_client,
    running_cluster,
    signed,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[LocalCluster]:
    # a test may ask for more LocalCluster arguments (indirect parametrization: WITH_TLS)
    with running_cluster(tmp_path, n_servers=4, **getattr(request, "param", {})) as c:
        yield c


#: the variant of a test with TLS on every port (issue 28), over HTTP only: the clients' pushes,
#: the peers' two-phase commit and state transfer all go through aiohttp with the test's CA. One
#: test has it (the restart, whose wiped server is refilled by state transfer under pushes, so
#: every HTTP path of the peers runs over TLS): a second variant only cost CI time. The data
#: plane's TLS variant is tests/system/test_dataplane_failover.py's.
WITH_TLS = pytest.mark.parametrize(
    "cluster", [{}, {"tls": True, "data_plane": False}], indirect=True, ids=["plain", "tls-http"]
)


def run_load_with_fault(
    c: LocalCluster, fault, settle: float = 1.0, after: float = 4.0
) -> tuple[ExactnessLoad, dict]:
    client, layout = make_client(c)
    load = ExactnessLoad(client, layout, "x", threads=4)
    load.start()
    time.sleep(settle)
    info = fault() or {}
    time.sleep(after)
    load.stop()
    values, _ = client.pull(["x"])
    counts = load.check(values["x"])
    print(f"outcomes: {counts}; fault: {info}")
    # the load kept being acknowledged through the fault (a liveness floor: 4 threads over the
    # ~6 s acknowledged 45-149 pushes on 2 cores at load 6-21, the fewer the higher the load;
    # the test's point is the exactness check above, which holds at any rate)
    assert counts["acked"] > 20
    digests_agree(c)
    client.close()
    return load, info


#: a tensor over every bucket under torch's Adam (with amsgrad: 3 state arrays and a step count
#: per shard): its state must survive a failover and a state transfer exactly
ADAM = TensorSpec("adam", (16_000,))
ADAM_OPT = {"kind": "adam", "lr": 0.01, "amsgrad": True, "weight_decay": 0.01}


#: a table under sparse_adam (per row: two moments and a step count) whose rows every step
#: pushes, so that torch.optim.SparseAdam on an nn.Embedding(sparse=True) is its reference
ROWS, ROW_IDS, ROW_DIM = "adam_rows", np.arange(0, 3_000, 7, dtype=np.int64), 4
ROW_OPT = {"kind": "sparse_adam", "lr": 0.01, "betas": [0.8, 0.99]}


class AdamProbe:
    """Pushes half its gradients before a fault and half after; `check` compares the pulled
    values with torch.optim.Adam given the same gradients (1 replica, one push per step), and
    the table's rows with torch.optim.SparseAdam."""

    STEPS = 40

    def __init__(self, c: LocalCluster) -> None:
        layout = Layout([TENSOR, ADAM], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        self.client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=30.0)
        self.client.create(ADAM, init={"kind": "normal", "std": 0.5, "seed": 2}, optimizer=ADAM_OPT)
        init = {"kind": "normal", "std": 0.5, "seed": 5}
        self.client.create_table(ROWS, ROW_DIM, init=init, optimizer=ROW_OPT)
        self.w0 = self.client.pull(["adam"])[0]["adam"].copy()
        self.r0 = self.client.pull_rows(ROWS, ROW_IDS).copy()
        rng = np.random.default_rng(4)
        self.grads = [rng.normal(size=ADAM.shape).astype(np.float32) for _ in range(self.STEPS)]
        shape = (len(ROW_IDS), ROW_DIM)
        self.row_grads = [rng.normal(size=shape).astype(np.float32) for _ in range(self.STEPS)]
        self._push(0, self.STEPS // 2)

    def _push(self, lo: int, hi: int) -> None:
        for i in range(lo, hi):
            self.client.push_dense("adam", self.grads[i])
            self.client.push_rows(ROWS, ROW_IDS, self.row_grads[i])

    def check(self) -> None:
        torch = pytest.importorskip("torch")
        self._push(self.STEPS // 2, self.STEPS)
        got = self.client.pull(["adam"])[0]["adam"]
        rows = self.client.pull_rows(ROWS, ROW_IDS)
        p = torch.nn.Parameter(torch.from_numpy(self.w0.copy()))
        kw = {k: v for k, v in ADAM_OPT.items() if k != "kind"}
        opt = torch.optim.Adam([p], foreach=False, **kw)
        for g in self.grads:
            p.grad = torch.from_numpy(g.copy())
            opt.step()
        self.client.close()
        np.testing.assert_allclose(got, p.detach().numpy(), rtol=1e-6, atol=1e-6)
        emb = torch.nn.Embedding(*self.r0.shape, sparse=True)
        with torch.no_grad():
            emb.weight.copy_(torch.from_numpy(self.r0))
        sparse = torch.optim.SparseAdam(emb.parameters(), lr=0.01, betas=(0.8, 0.99))
        for g in self.row_grads:
            sparse.zero_grad()
            emb(torch.arange(len(ROW_IDS))).backward(torch.from_numpy(g))
            sparse.step()
        np.testing.assert_allclose(rows, emb.weight.detach().numpy(), rtol=1e-6, atol=1e-6)


def primaries_of(view: dict, sid: str) -> list[int]:
    return [b["bucket"] for b in view["buckets"] if b["primary"] == sid]


def busiest_primary(c: LocalCluster) -> str:
    view = c.cluster()
    return max(c.server_ids, key=lambda s: len(primaries_of(view, s)))


def test_primary_sigkill_under_load_loses_nothing_acknowledged(cluster: LocalCluster) -> None:
    victim = busiest_primary(cluster)
    layout = Layout([TENSOR], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    state: dict = {}
    probe = AdamProbe(cluster)

    def fault() -> dict:
        view = cluster.cluster()
        state["buckets"] = set(primaries_of(view, victim))
        state["killed_at"] = time.monotonic()
        cluster.kill(victim)
        return {"victim": victim, "buckets": sorted(state["buckets"])}

    load, _ = run_load_with_fault(cluster, fault, after=2 * LEASE + 3)
    # Failover time: from the kill to the first acknowledged push to a bucket the victim led.
    moved = [
        t for t, e in load.out.ack_times
        if t > state["killed_at"] and layout.bucket_of[layout.shards_of["x"][0].id] is not None
        and layout.bucket_of[next(s.id for s in layout.shards_of["x"] if s.start <= e < s.stop)] in state["buckets"]
    ]  # fmt: skip
    assert moved, "no push to the failed primary's buckets succeeded after the kill"
    failover = min(moved) - state["killed_at"]
    print(f"measured failover time: {failover:.2f} s (lease {LEASE} s)")
    assert failover < 2 * LEASE + 1.0
    # the Adam state the new primaries took over (replicated by 2PC) is the one the dead
    # primary had: the second half of the steps continues it exactly
    probe.check()
    digests_agree(cluster)


def test_primary_paused_beyond_its_lease_is_fenced(cluster: LocalCluster) -> None:
    victim = busiest_primary(cluster)
    addr = cluster.servers[cluster.server_ids.index(victim)]
    state: dict = {}

    def fault() -> dict:
        view = cluster.cluster()
        state["bucket"] = primaries_of(view, victim)[0]
        state["epoch"] = next(b["epoch"] for b in view["buckets"] if b["bucket"] == state["bucket"])
        cluster.pause(victim)
        time.sleep(2 * LEASE + 1.5)
        cluster.resume(victim)
        return {"victim": victim, "bucket": state["bucket"]}

    run_load_with_fault(cluster, fault, after=2.0)
    view = cluster.cluster()
    b = state["bucket"]
    entry = next(x for x in view["buckets"] if x["bucket"] == b)
    assert entry["primary"] != victim and entry["epoch"] > state["epoch"]
    # The old primary refuses writes for the bucket it led...
    layout = Layout([TENSOR], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    sid = next(s.id for s in layout.shards_of["x"] if layout.bucket_of[s.id] == b)
    with SyncRpc(addr, TOKEN) as rpc, pytest.raises(RpcError) as info:
        rpc.call("push_dense", shards={sid: np.zeros(layout.shards[sid].shape, np.float32)})
    assert info.value.code == "not_primary"
    # ... and a 2PC message under its old epoch is refused by the bucket's members.
    sec = entry["secondaries"][0]
    member = view["servers"][sec]["address"]
    with SyncRpc(member, TOKEN) as rpc, pytest.raises(RpcError) as info:
        signed(rpc, cluster, victim, sec, "repl_prepare", bucket=b, epoch=state["epoch"],
               sender=victim, entries=[])  # fmt: skip
    assert info.value.code == "stale_epoch"


def test_secondary_sigkill_primary_continues_and_a_replacement_catches_up(
    cluster: LocalCluster,
) -> None:
    view = cluster.cluster()
    # A server that is a secondary of some bucket (all are, with 4 servers and 3 copies).
    victim = view["buckets"][0]["secondaries"][0]

    def fault() -> dict:
        cluster.kill(victim)
        return {"victim": victim}

    run_load_with_fault(cluster, fault, after=4.0)
    view = cluster.wait_placed(timeout=30)
    assert all(victim not in [b["primary"], *b["secondaries"]] for b in view["buckets"])


@WITH_TLS
def test_servers_restarted_with_and_without_their_lmdb_rejoin_and_catch_up(
    cluster: LocalCluster,
) -> None:
    a, b = cluster.server_ids[0], cluster.server_ids[1]
    probe = AdamProbe(cluster)

    def fault() -> dict:
        cluster.kill(a)
        cluster.start_server(0)  # LMDB directory intact
        time.sleep(1.0)
        cluster.kill(b)
        cluster.start_server(1, wipe=True)  # LMDB directory wiped
        return {"restarted": a, "wiped": b}

    run_load_with_fault(cluster, fault, after=3.0)

    def rejoined(view: dict) -> bool:  # both hold copies again (a slow start may come late)
        holders = {s for x in view["buckets"] for s in [x["primary"], *x["secondaries"]]}
        return {a, b} <= holders

    cluster.wait_for(rejoined, "both restarted servers hold copies again", 40)
    cluster.wait_placed(timeout=40)
    # the wiped server's copies came by state transfer (the optimizer state with them): the
    # replicas' digests (values and state) agree, and Adam's steps continue exactly
    probe.check()
    digests_agree(cluster)


def test_controller_leader_killed_during_a_server_failover(cluster: LocalCluster) -> None:
    victim = busiest_primary(cluster)

    def fault() -> dict:
        leader = cluster.controller_leader()
        assert leader is not None
        cluster.kill(victim)
        time.sleep(0.5)
        cluster.kill(f"controller{leader}")
        return {"victim": victim, "controller": leader}

    run_load_with_fault(cluster, fault, after=2 * LEASE + 4)
    view = cluster.wait_placed(timeout=30)
    assert all(b["primary"] != victim for b in view["buckets"])
