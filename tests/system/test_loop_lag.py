"""No single request holds a parameter server's event loop for more than 100 ms (issue 39).

Reference: docs/operations.md, "The event loop"; adamps/wire/looplag.py. A create_table with a large
``filter_width`` allocated and serialized its frequency sketches on the event loop (a server of
a cluster was held more than 10 s and declared dead); a create of the largest tensor allowed
drew its initial values there. The server's probe (``adamps_event_loop_blocked_seconds``: how
late its 10 ms timer woke, less the time its thread waited for a CPU) is read around each
request, and no request may add an observation above 100 ms.

Every kind of request the server answers is probed: the table below must name each /rpc op,
HTTP route and data-plane frame the server lists in its /status (``served``), so an op added
without an entry here fails this test. Sizes are the largest the server accepts (its
``max_tensor_elems``, ``MAX_IDS`` rows, the widest filter), on a server of 8 buckets. A
standalone server is probed: a replicated server's peer ops (2PC, state transfer) are not
listed by it and need a cluster: tests/system/test_loop_lag_peers.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from adamps import tables
from adamps.client.dataplane import DataPlaneClient
from adamps.client.rpc import SyncRpc
from adamps.compression import codec
from adamps.server.api.tableops import MAX_IDS
from adamps.up.procs import Proc, adamps_argv, free_port
from tests import looplag_probe
from tests.looplag_probe import BOUND

pytestmark = pytest.mark.slow

TOKEN = "lag-token"
#: the server's largest tensor (its --max-tensor-elems): 64 MiB of float32
MAX_ELEMS = 1 << 24
N_BUCKETS = 8
DIM = 16
BIG = [4096, MAX_ELEMS // 4096]
#: the widest frequency filter a table may have (adamps.tables.MAX_FILTER_WIDTH)
FILTER_WIDTH = 1 << 20


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("lag")
    port, dport = free_port(), free_port()
    argv = adamps_argv("ps", "--port", str(port), "--data-port", str(dport),
                       "--data-dir", str(tmp / "lmdb"), "--n-buckets", str(N_BUCKETS),
                       "--max-tensor-elems", str(MAX_ELEMS), "--flush-interval", "0.5",
                       "--max-unflushed", "120")  # fmt: skip
    proc = Proc(argv, tmp / "ps.log", env={"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1", **looplag_probe.ENV},
                name="ps")  # fmt: skip
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
        with SyncRpc(f"http://127.0.0.1:{port}", TOKEN, timeout=120) as rpc:
            yield rpc, dport, proc
    finally:
        proc.stop()


def over_bound(rpc: SyncRpc) -> dict[float, int]:
    return looplag_probe.over_bound(rpc.base_url.split("//")[1])


def rows_ids(n: int) -> np.ndarray:
    return np.arange(n, dtype=np.int64) * 7919


def requests(rpc: SyncRpc, dport: int) -> dict[str, Callable[[], Any]]:
    """Request kind -> a call of it at its largest ("rpc:<op>", "http:<route>", "dp:<frame>")."""
    rng = np.random.default_rng(0)
    big_delta = np.full(BIG, 1e-3, np.float32)
    per = 262_144 // BIG[1]  # rows of a 1 MB shard
    dense = {f"big/{i}": big_delta[i * per : (i + 1) * per] for i in range(BIG[0] // per)}
    fc_a = rng.standard_normal((8, 4096)).astype(np.float32)
    fc_e = rng.standard_normal((8, 4096)).astype(np.float32)
    size = 262_144  # one whole 1 MB shard of "big", every element coded
    idx = np.arange(size, dtype=np.int64)
    rice, k = codec.rice_encode(idx, np.zeros(size, bool), size=size)
    comp = {"big/0": {"tau": 1e-3, "n": size, "k": k, "rice": np.frombuffer(rice, np.uint8)}}
    ids = rows_ids(MAX_IDS)
    grads = np.full((MAX_IDS, DIM), 1e-3, np.float32)
    table = {"name": "emb", "dim": DIM, "optimizer": {"kind": "adagrad", "lr": 0.1},
             "admission": {"admit_after": 2, "filter_width": FILTER_WIDTH,
                           "max_rows": 1 << 22}}  # fmt: skip
    held: dict[str, Any] = {}

    def dp() -> DataPlaneClient:
        return DataPlaneClient("127.0.0.1", dport, TOKEN, timeout=120)

    def dp_push() -> Any:
        with dp() as c:
            return c.push_dense("big", big_delta)

    def dp_pull() -> Any:
        with dp() as c:
            return c.pull("big")[1]

    def dp_message(op: str, **fields: Any) -> Any:
        with dp() as c:
            c.send_message(op, **fields)
            return c.read_message_reply()

    def ckpt_hold() -> Any:
        if "cut" in held:
            rpc.call("ckpt_release", cut=held["cut"], drop=True)
        held["cut"] = f"c{time.monotonic_ns()}"
        return rpc.call("ckpt_hold", cut=held["cut"], seconds=5)

    def ckpt_read() -> Any:
        held["snap"] = rpc.call("ckpt_read", bucket=0)
        return held["snap"]

    def ckpt_install(send: Callable[..., Any] = rpc.call) -> Any:
        shards = {sid: {"v": s["v"]} for sid, s in held["snap"]["shards"].items()}
        return send("ckpt_install", bucket=0, shards=shards, force=True)

    def get(path: str) -> Callable[[], Any]:
        return lambda: rpc.get_json(path) if path != "/metrics" else over_bound(rpc)

    # a replica's whole round: an fc layer of "big", the largest row push and fetch, and the
    # whole of "big" fetched after its writes (a synchronous Downpour step)
    round_ = {"layers": {"big": {"a": fc_a, "e": fc_e}},
              "rows": [{"table": "emb", "ids": ids, "grads": grads}],
              "fetch_rows": [{"table": "emb", "ids": ids}],
              "fetch_shards": [f"big/{i}" for i in range(64)]}  # fmt: skip

    return {
        # a create is probed again under a new name (a repeated create allocates nothing)
        "rpc:create": lambda again=0: rpc.call(
            "create",
            name="big" + "x" * again,
            shape=BIG,
            init={"kind": "normal", "seed": 1},
            optimizer={"kind": "adagrad", "lr": 0.1},
        ),  # fmt: skip
        # a restore's creates: three tensors with their values inline (their check is a pass
        # over every element)
        "rpc:create_tensors": lambda again=0: rpc.call(
            "create_tensors",
            tensors=[
                {
                    "name": f"ct{again}_{k}",
                    "shape": [1 << 22],
                    "init": {"kind": "values", "values": np.full(1 << 22, 0.5, np.float32)},
                }
                for k in range(3)
            ],
        ),  # fmt: skip
        "rpc:create_table": lambda again=0: rpc.call(
            "create_table", **{**table, "name": "emb" + "x" * again}
        ),  # fmt: skip
        "rpc:describe": lambda: rpc.call("describe", name="big"),
        "rpc:list": lambda: rpc.call("list"),
        "rpc:list_tables": lambda: rpc.call("list_tables"),
        "rpc:push_dense": lambda: rpc.call("push_dense", shards=dense),
        "rpc:pull": lambda: rpc.call("pull", tensors=["big"]),
        "rpc:push_fc": lambda: rpc.call("push_fc", tensor="big", a=fc_a, e=fc_e),
        "rpc:push_compressed": lambda: rpc.call("push_compressed", shards=comp),
        "rpc:vec_dot": lambda: rpc.call(
            "vec_dot", shards=[f"big/{i}" for i in range(64)], x="", y=""
        ),  # fmt: skip
        "rpc:vec": lambda: rpc.call(
            "vec", kind="scale", shards=[f"big/{i}" for i in range(64)], y="", alpha=1.0
        ),  # fmt: skip
        "rpc:push_rows": lambda: rpc.call("push_rows", table="emb", ids=ids, grads=grads),
        "rpc:pull_rows": lambda: rpc.call("pull_rows", table="emb", ids=ids),
        "rpc:put_rows": lambda: rpc.call("put_rows", table="emb", ids=ids, values=grads),
        "rpc:flush": lambda: rpc.call("flush"),
        "rpc:clock": lambda: rpc.call("clock", run="r", replica="a", mode="async", step=1),
        "rpc:ckpt_hold": ckpt_hold,
        "rpc:ckpt_release": lambda: rpc.call("ckpt_release", cut=held["cut"]),
        "rpc:ckpt_read": ckpt_read,
        # a save's read on the data plane: the bucket's arrays come back as the raw payload
        "dp:ckpt_read": lambda: dp_message("ckpt_read", bucket=0),
        "rpc:ckpt_install": ckpt_install,
        "dp:ckpt_install": lambda: ckpt_install(dp_message),
        "http:POST /rpc": lambda: rpc.call("list"),
        "http:POST /flush": lambda: rpc.post_json("/flush"),
        "http:GET /healthz": get("/healthz"),
        "http:GET /status": get("/status"),
        "http:GET /metrics": get("/metrics"),
        "dp:push_dense": dp_push,
        "dp:pull": dp_pull,
        "dp:push_fc": lambda: dp_message("push_fc", tensor="big", a=fc_a, e=fc_e),
        "dp:push_compressed": lambda: dp_message("push_compressed", shards=comp),
        "dp:push_rows": lambda: dp_message("push_rows", table="emb", ids=ids, grads=grads),
        "dp:pull_rows": lambda: dp_message("pull_rows", table="emb", ids=ids),
        "dp:put_rows": lambda: dp_message("put_rows", table="emb", ids=ids, values=grads),
        # a round after the row pushes: its probe overlaps their flush, whose row-block headers
        # (the widest filter's sketches, 16 MiB a bucket) were built holding the GIL (issue 39)
        "rpc:round": lambda: rpc.call("round", **round_),
        "dp:round": lambda: dp_message("round", **round_),
    }


@pytest.mark.timeout(600)
def test_no_request_holds_the_event_loop_past_100ms(server) -> None:
    rpc, dport, proc = server
    table = requests(rpc, dport)
    time.sleep(0.5)
    slow = looplag_probe.probe(table, [rpc.base_url.split("//")[1]])
    assert not slow, f"requests that held the loop over {BOUND * 1000:g} ms: {slow}"
    served = rpc.get_json("/status")["served"]
    kinds = (
        {f"rpc:{op}" for op in served["rpc"]}
        | {f"http:{r}" for r in served["routes"]}
        | {f"dp:{f}" for f in served["data_plane"]}
    )
    assert kinds - set(table) == set(), "request kinds this test does not probe"
    assert tables.MAX_FILTER_WIDTH == FILTER_WIDTH
