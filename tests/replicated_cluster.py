"""What the replicated-cluster fault tests share (system/test_failover.py,
system/test_compressed_failover.py, chaos/test_partitions.py): one tensor of 16 shards over 8
buckets, a cluster of 3 controllers and N parameter servers with the fast timings, a client that
creates the tensor, and the check that every bucket's replicas agree. The tests import it by
putting tests/ on sys.path (they run in importlib mode)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from adamps.client import ControllerRouting, PSClient
from adamps.client.dataplane import REQUEST, frame_header
from adamps.client.rpc import RpcError, SyncRpc, rpc_request
from adamps.layout import Layout, TensorSpec
from adamps.security import peer_auth
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_LEASE, FAST_PS_OPTS, LocalCluster
from adamps.wire import protocol

TOKEN = "test-token"
LEASE = FAST_LEASE
N_BUCKETS = 8
TENSOR = TensorSpec("x", (16_000,))
SHARD = 1_000  # 16 shards over 8 buckets


@contextmanager
def running_cluster(
    root: Path,
    n_servers: int,
    n_buckets: int = N_BUCKETS,
    shard: int = SHARD,
    token: str = TOKEN,
    **more: Any,
) -> Iterator[LocalCluster]:
    """A started cluster, every bucket placed; stopped on exit. `more`: further LocalCluster
    arguments (where the processes run)."""
    c = LocalCluster(
        root,
        token=token,
        n_servers=n_servers,
        n_buckets=n_buckets,
        controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts={**FAST_PS_OPTS, "max-shard-elems": shard},
        **more,
    )  # fmt: skip
    try:
        c.start(timeout=60)
        yield c
    finally:
        c.stop()


def make_client(c: LocalCluster) -> tuple[PSClient, Layout]:
    """A client of `c` that created TENSOR (zeros; SGD with lr -1, so a push of d adds d)."""
    layout = Layout([TENSOR], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
    client = PSClient(ControllerRouting(c.controllers), layout, TOKEN, retry_for=20.0)
    client.create(TENSOR, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
    return client, layout


def digests_agree(c: LocalCluster, timeout: float = 20.0) -> None:
    """Every bucket's replicas report the same position and the same digest of their values."""
    deadline = time.monotonic() + timeout
    last: list = []
    while time.monotonic() < deadline:
        view = c.cluster()
        if view is None:
            time.sleep(0.2)
            continue
        servers = view["servers"]
        last = []
        ok = True
        for b in view["buckets"]:
            members = [b["primary"], *b["secondaries"]]
            answers = []
            for sid in members:
                with SyncRpc(servers[sid]["address"], TOKEN, timeout=2.0) as rpc:
                    try:
                        answers.append(rpc.call("digest", bucket=b["bucket"]))
                    except (RpcError, ConnectionError, TimeoutError) as exc:
                        answers.append({"error": str(exc)})
            last.append((b["bucket"], members, answers))
            if len({(a.get("digest"), a.get("committed")) for a in answers}) != 1:
                ok = False
        if ok:
            return
        time.sleep(0.3)
    raise AssertionError(f"replica digests differ: {last}")


def signed(rpc: SyncRpc, c: LocalCluster, sender: str, receiver: str, op: str, /, **fields: Any):
    """`op` on `receiver`'s /rpc as server `sender` sends it: with the MAC of the body under
    their pair key (adamps.security.peer_auth; the test holds the cluster's peer token)."""
    req = rpc_request(op, **fields)
    assert req.body is not None
    key = peer_auth.pair_key(c.peer_token, sender, receiver)
    hdr = ((peer_auth.PEER_HEADER, peer_auth.header(sender, key, req.body)),)
    return rpc.send(dataclasses.replace(req, extra_headers=hdr))


def _arrays(x: Any) -> list[dict[str, Any]]:
    """The out-of-band array descriptors ({dtype, shape, at}) anywhere in `x`."""
    if isinstance(x, dict):
        if "at" in x and "dtype" in x:
            return [x]
        return [a for v in x.values() for a in _arrays(v)]
    if isinstance(x, list | tuple):
        return [a for v in x for a in _arrays(v)]
    return []


def signed_frame(
    c: LocalCluster, sender: str, receiver: str, items: list[Any], payload: bytes = b""
) -> bytes:
    """A repl_multi frame for `receiver`'s data port as server `sender` sends it: its id and the
    MAC's form in the meta, the segmented frame MAC appended to the payload (the payload as one
    segment: the meta's arrays, if any, are where a test put them)."""
    req = protocol.request(
        "repl_multi", token=TOKEN, peer=sender, mac=peer_auth.FRAME_MAC, items=items
    )
    meta = protocol.encode(req)
    key = peer_auth.pair_key(c.peer_token, sender, receiver)
    offsets = [int(a["at"]) for a in _arrays(items)]
    segments = peer_auth.segment_digests(memoryview(payload), offsets)
    mac = peer_auth.frame_mac(key, meta, segments)
    return frame_header(REQUEST, len(meta), len(payload) + len(mac)) + meta + payload + mac
