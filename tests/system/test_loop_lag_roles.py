"""No single request holds a controller's or a data server's event loop for more than 100 ms
(issue 39: "the loop-lag probe covers every request kind"; test_loop_lag.py covers a parameter
server's).

Reference: docs/operations.md, "The event loop"; adamps/wire/looplag.py; tests/looplag_probe.py.

Controllers: a real cluster of 3 controllers and one parameter server (LocalCluster, peer
identity on). Every HTTP route a controller lists in its /status (``served``) must have an
entry in `controller_requests`, each sent at the largest size the controllers accept (a layout
of 4096 tensors and 2^20 shards, 4096 peer keys, reports of every bucket) on a state filled with
runs and a full progress board, and every controller's blocked-time histogram is read around
each request (a follower forwards writes: both loops count).

Data server: `adamps dataserver` on the builtin dataset with its default augmentation worker:
every route it lists is probed (a stream of the largest batch it allows, the whole training
set; a lease of the most epochs; /runs with the most runs it keeps).

Trainer: its metrics port (/healthz, /status, /metrics on a loop in a thread of its own) read
all along while it trains.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from adamps import runs as run_names
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec
from adamps.security import peer_auth
from adamps.testing.exactness import ExactnessLoad
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_LEASE, FAST_PS_OPTS, LocalCluster
from adamps.up.procs import Proc, adamps_argv, free_port
from adamps.wire import protocol
from controller.cluster_rules import PROGRESS_REPLICAS_PER_RUN
from controller.service import MAX_PEER_KEYS
from dataserver.elastic import MAX_EPOCHS, MAX_RUNS
from tests import looplag_probe
from tests.looplag_probe import BOUND, request

pytestmark = pytest.mark.slow

TOKEN = "lag-token"
N_BUCKETS = 64
#: the largest layout a controller accepts (its defaults): max_layout_tensors tensors cut into
#: max_layout_shards shards (256 one-element shards each)
LAYOUT_TENSORS = 4096
LAYOUT_SHARDS = 1 << 20
#: runs kept by the controllers while probing (GET /runs, a run token's lookup)
N_RUNS = 128
FAKE = "lagps"  #: a server id the test registers (no process behind it)


def _json(addr: str, method: str, path: str, body: Any = None, headers: Any = None,
          ok: tuple[int, ...] = (200,)) -> Any:  # fmt: skip
    raw = None if body is None else json.dumps(body).encode()
    hdr = {
        "Authorization": f"Bearer {TOKEN}",
        "Content-Type": "application/json",
        **(headers or {}),
    }
    code, got = request(addr, method, path, raw, hdr)
    assert code in ok, f"{method} {path}: {code} {got[:300]!r}"
    return got


def layout(prefix: str = "") -> dict[str, Any]:
    per = LAYOUT_SHARDS // LAYOUT_TENSORS
    tensors = [{"name": f"{prefix}layer{i:04d}.weight", "shape": [per], "dtype": "float32"}
               for i in range(LAYOUT_TENSORS)]  # fmt: skip
    return {"n_buckets": N_BUCKETS, "max_shard_elems": 1, "tensors": tensors}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    c = LocalCluster(tmp_path_factory.mktemp("lagctl"), token=TOKEN, n_controllers=3,
                     n_servers=1, n_buckets=N_BUCKETS, env=looplag_probe.ENV,
                     controller_opts={"replication": 1})  # fmt: skip
    try:
        c.start(timeout=90)
        yield c
    finally:
        c.stop()


def server_call(c: LocalCluster, sid: str, path: str, body: Any, ok=(200,)) -> Any:
    """A write only a server makes, with server `sid`'s proof of its own key (peer identity)."""
    raw = json.dumps(body).encode()
    key = peer_auth.server_key(c.peer_token, sid)
    proof = peer_auth.server_call_header(key, sid, int(time.time()), "POST", path, raw)
    hdr = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json",
           peer_auth.SERVER_HEADER: proof}  # fmt: skip
    code, got = request(c.controllers[0], "POST", path, raw, hdr)
    assert code in ok, f"POST {path}: {code} {got[:300]!r}"
    return got


def fill(c: LocalCluster) -> None:
    """The state a busy cluster holds: N_RUNS runs, a full progress board for one epoch."""
    addr = c.controllers[0]
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(lambda i: _json(addr, "POST", "/runs", {"name": f"lagrun{i}"}), range(N_RUNS))
        )
        list(pool.map(lambda i: _json(addr, "POST", "/progress", {"epoch": 1, "replica": f"r{i}",
                                      "progress": 0.5}), range(PROGRESS_REPLICAS_PER_RUN - 1)))  # fmt: skip


def controller_requests(c: LocalCluster) -> dict[str, Callable[[], Any]]:
    """Route ("METHOD /canonical") -> a call of it at its largest."""
    addr = c.controllers[0]
    reports = {str(b): [1, 1000] for b in range(N_BUCKETS)}
    key = peer_auth.server_key(c.peer_token, FAKE)
    big = layout()
    run_part = layout(prefix=run_names.namespace("lagrun0"))
    cost = run_names.tensor_cost(1 << 20, 1 << 20)

    def get(path: str) -> Callable[[], Any]:
        return lambda: _json(addr, "GET", path)

    def peer_keys() -> Any:
        when = int(time.time())
        body = {"time": when, "proof": peer_auth.proof(key, FAKE, when),
                "peers": [f"ps{i}" for i in range(MAX_PEER_KEYS)]}  # fmt: skip
        return _json(addr, "POST", f"/servers/{FAKE}/peer-keys", body)

    return {
        "GET /healthz": get("/healthz"),
        "GET /status": get("/status"),
        "GET /metrics": get("/metrics"),
        "PUT /layout": lambda: _json(addr, "PUT", "/layout", big),
        "POST /layout": lambda: _json(
            addr, "POST", "/layout", {"layout": run_part, "run": "lagrun0"}
        ),
        "GET /layout": get("/layout"),
        "GET /routing": get("/routing"),
        "GET /cluster": get("/cluster"),
        "GET /leases": get("/leases"),
        "GET /state/digest": get("/state/digest"),
        "POST /progress": lambda: _json(
            addr, "POST", "/progress", {"epoch": 1, "replica": "lag", "progress": 1.0, "done": True}
        ),  # fmt: skip
        "GET /progress": get("/progress"),
        "POST /servers/{id}/register": lambda: server_call(
            c,
            FAKE,
            f"/servers/{FAKE}/register",
            {"address": "127.0.0.1:9", "copies": reports, "n_buckets": N_BUCKETS},
        ),  # fmt: skip
        "POST /servers/{id}/heartbeat": lambda: server_call(
            c,
            FAKE,
            f"/servers/{FAKE}/heartbeat",
            {"known_version": 0, "reports": reports, "not_durable": None},
            ok=(200, 409),
        ),  # fmt: skip
        "GET /servers/{id}": get(f"/servers/{FAKE}"),
        "POST /servers/{id}/peer-keys": peer_keys,
        "POST /servers/{id}/drain": lambda: _json(
            addr, "POST", f"/servers/{FAKE}/drain", {}, ok=(200, 409)
        ),  # fmt: skip
        "POST /servers/{id}/undrain": lambda: _json(
            addr, "POST", f"/servers/{FAKE}/undrain", {}, ok=(200, 409)
        ),  # fmt: skip
        "POST /rebalance": lambda: _json(addr, "POST", "/rebalance", {}, ok=(200, 409)),
        # A server's role change (refused: a stale epoch) and an operator's declare-lost
        # (refused: the bucket has a primary); both run the handler and the dry run.
        "POST /buckets/{bucket}/{op}": lambda: (
            server_call(
                c,
                FAKE,
                "/buckets/0/role-change",
                {"server": FAKE, "prev_epoch": 0, "reports": reports},
                ok=(409,),
            ),
            _json(addr, "POST", "/buckets/0/declare-lost", {}, ok=(409,)),
        ),  # fmt: skip
        "POST /runs": lambda again=0: _json(
            addr,
            "POST",
            "/runs",
            {
                "name": f"lagnew{again}",
                "consistency": "ssp:3",
                "quotas": {"param_elems": 1 << 30, "table_rows": 1 << 24},
            },
        ),  # fmt: skip
        "GET /runs": get("/runs"),
        "GET /runs/{name}": get("/runs/lagrun0"),
        "POST /runs/{name}/usage": lambda again=0: _json(
            addr,
            "POST",
            "/runs/lagrun1/usage",
            {"name": f"{run_names.namespace('lagrun1')}t{again}", "cost": cost},
        ),  # fmt: skip
        "DELETE /runs/{name}": lambda again=0: _json(addr, "DELETE", f"/runs/lagnew{again}"),
        "GET /auth/runs": get("/auth/runs"),
    }


@pytest.mark.timeout(600)
def test_no_controller_request_holds_the_event_loop_past_100ms(cluster: LocalCluster) -> None:
    fill(cluster)
    table = controller_requests(cluster)
    time.sleep(0.5)
    slow = looplag_probe.probe(table, cluster.controllers, settle=0.8)
    assert not slow, f"controller requests that held a loop over {BOUND * 1000:g} ms: {slow}"
    for addr in cluster.controllers:
        routes = json.loads(_json(addr, "GET", "/status"))["served"]["routes"]
        assert set(routes) - set(table) == set(), "controller routes this test does not probe"


@pytest.fixture(scope="module")
def dataserver(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("lagds")
    port = free_port()
    proc = Proc(adamps_argv("dataserver", "--host", "127.0.0.1", "--port", str(port),
                            "--source", "builtin"), tmp / "ds.log",
                env={"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1", **looplag_probe.ENV},
                name="dataserver")  # fmt: skip
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=90)
        yield f"127.0.0.1:{port}"
    finally:
        proc.stop()


def _msg(addr: str, path: str, op: str, ok: tuple[int, ...] = (200,), **fields: Any) -> bytes:
    body = protocol.encode(protocol.request(op, **fields))
    hdr = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/msgpack"}
    code, got = request(addr, "POST", path, body, hdr)
    assert code in ok, f"POST {path}: {code} {got[:300]!r}"
    return got


def dataserver_requests(addr: str) -> dict[str, Callable[[], Any]]:
    status = json.loads(_json(addr, "GET", "/status"))
    n_train, max_batch = status["n_train"], status["config"]["max_batch"]
    assert max_batch >= n_train  # one batch: the whole training set

    def stream(split: str, epoch: int) -> Any:
        got = _msg(addr, "/stream", "stream", replica=0, n_replicas=1, epoch=epoch,
                   batch_size=max_batch, split=split)  # fmt: skip
        assert len(got) > (n_train if split == "train" else 1) * 28 * 28, len(got)
        return got

    def lease(run: str, replica: str = "a") -> dict[str, Any]:
        return protocol.decode(_msg(addr, "/lease", "lease", run=run, replica=replica,
                                    epochs=MAX_EPOCHS))  # fmt: skip

    held: dict[str, Any] = {}

    def complete() -> Any:
        g = held.get("grant") or lease("lag")
        held["grant"] = lease("lag")
        return _msg(addr, "/complete", "complete", run="lag", replica="a", epoch=g["epoch"],
                    slice=g["slice"])  # fmt: skip

    return {
        "GET /healthz": lambda: _json(addr, "GET", "/healthz"),
        "GET /status": lambda: _json(addr, "GET", "/status"),
        "GET /metrics": lambda: _json(addr, "GET", "/metrics"),
        # epoch 0 is augmented ahead at start; epoch 5's augmentation starts with the request
        "POST /stream": lambda again=0: (stream("train", 5 + again), stream("test", again)),
        "POST /lease": lambda: lease("lag"),
        "POST /complete": complete,
        "POST /heartbeat": lambda: _msg(addr, "/heartbeat", "heartbeat", run="lag", replica="a"),
        "GET /runs": lambda: _json(addr, "GET", "/runs"),
    }


@pytest.mark.timeout(600)
def test_no_dataserver_request_holds_the_event_loop_past_100ms(dataserver: str) -> None:
    addr = dataserver
    with ThreadPoolExecutor(8) as pool:  # the most runs it keeps, each with a replica's lease
        list(pool.map(lambda i: _msg(addr, "/lease", "lease", run=f"r{i}", replica="a",
                                     epochs=MAX_EPOCHS), range(MAX_RUNS - 1)))  # fmt: skip
    table = dataserver_requests(addr)
    time.sleep(0.5)
    slow = looplag_probe.probe(table, [addr], settle=0.8)
    assert not slow, f"data server requests that held the loop over {BOUND * 1000:g} ms: {slow}"
    routes = json.loads(_json(addr, "GET", "/status"))["served"]["routes"]
    assert set(routes) - set(table) == set(), "data server routes this test does not probe"


@pytest.mark.timeout(600)
def test_a_trainers_metrics_port_answers_promptly_while_it_trains(tmp_path) -> None:
    """A trainer serves /healthz, /status and /metrics from an event loop in a thread of its
    own while its main thread trains (trainer/metrics_server.py): the training (numpy, BLAS,
    the round client) must not hold that loop. The trainer's own probe (its blocked-time
    histogram, read before and all along) records no hold past BOUND while it trains two
    epochs, and its /status answers all along. Not probed: the wind-down after its last epoch
    (workers stopped, results written), where one run in three saw a hold of 0.1-0.5 s."""
    c = LocalCluster(tmp_path, token=TOKEN, n_servers=1, n_buckets=8,
                     controller_opts={**FAST_CONTROLLER_OPTS, "replication": 1},
                     ps_opts=FAST_PS_OPTS, env=looplag_probe.ENV)  # fmt: skip
    try:
        c.start(timeout=90)
        ds = c.start_dataserver("--no-augment")
        port = free_port()
        proc = c.start_process(
            "train", "train", "--controllers", ",".join(c.controllers),
            "--dataservers", f"http://{ds}", "--epochs", "2", "--metrics-port", str(port),
        )  # fmt: skip
        addr = f"127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        before: dict[float, int] | None = None
        while before is None:
            assert proc.alive, proc.tail(40)
            assert time.monotonic() < deadline, "the trainer's metrics port never answered"
            try:
                before = looplag_probe.over_bound(addr)
            except (ConnectionError, OSError):
                time.sleep(0.2)
        worst, steps = 0.0, 0
        while proc.popen.poll() is None:
            t = time.perf_counter()
            try:
                code, body = request(addr, "GET", "/status", timeout=30)
            except (ConnectionError, OSError):
                break  # it finished meanwhile
            worst = max(worst, time.perf_counter() - t)
            assert code == 200
            status = json.loads(body)
            steps = max(steps, int(status.get("steps") or 0))
            if (status.get("completed_epoch") or 0) >= 2:
                break  # trained: its wind-down (workers stopped, results written) is not probed
            held = {hi: n - before.get(hi, 0) for hi, n in looplag_probe.over_bound(addr).items()
                    if n > before.get(hi, 0)}  # fmt: skip
            assert not held, f"the trainer's metrics loop was held past {BOUND} s: {held}"
            time.sleep(0.05)
        assert proc.popen.wait(60) == 0, proc.tail(40)
        print(f"worst /status {worst:.3f} s over {steps} steps")
        assert steps > 0, "the trainer was not probed while it trained"
    finally:
        c.stop()


#: the role changes the controllers commit (``adamps_controller_writes_total``'s op) and what
#: makes the cluster ask for each here; their routes are POST /buckets/{bucket}/{op}, whose
#: refusals alone `controller_requests` probes (declare-lost's success needs a bucket whose
#: every copy is gone: refused there, and not repeated here)
ROLE_CHANGES = {
    "release": "a server stopped in order hands its primary leases back",
    "verified_caught_up": "a drain's and a restart's copies join",
    "role_change": "a stopped (SIGSTOP) server's buckets fail over",
    "drop_secondary": "a primary drops a stopped secondary from a push's rounds",
}


def committed(addrs: list[str]) -> dict[str, int]:
    """Writes each controller of `addrs` committed as leader, by op (summed)."""
    out: dict[str, int] = {}
    for addr in addrs:
        text = looplag_probe.request(addr, "GET", "/metrics")[1].decode()
        for op, n in re.findall(
            r'adamps_controller_writes_total\{op="([^"]+)",result="ok"\} (\S+)', text
        ):
            out[op] = out.get(op, 0) + int(float(n))
    return out


#: the controllers' server timeout here: past a stopped server's leases (FAST_LEASE and the
#: skew and margin) and its secondaries' failover-after, so that its secondaries' role changes
#: take its buckets over before the leader declares it dead. With FAST_CONTROLLER_OPTS's 1 s
#: the leader declared it dead first, and its reconcile and the secondaries' role changes both
#: waited for the same lease expiry: whichever came first took the bucket (no role_change
#: committed in one run of three).
SERVER_TIMEOUT = 5.0
assert SERVER_TIMEOUT > FAST_LEASE + FAST_PS_OPTS["failover-after"] + 1.0

#: shards of the test's tensor "x": the fewest whose buckets are all 16 (16 shards reach 12),
#: so that a push of the whole of x has a round in every bucket
X_SHARDS = 42


def primaries(view: dict[str, Any], sid: str) -> int:
    return sum(b["primary"] == sid for b in view["buckets"])


def secondary_of(view: dict[str, Any], sid: str) -> list[int]:
    """The buckets (of a /cluster view) that `sid` holds a caught-up secondary copy of."""
    return [b["bucket"] for b in view["buckets"] if sid in b["secondaries"]]


def new_holds(addrs: list[str], before: dict[str, dict[float, int]]) -> dict[str, int]:
    return {
        f"{a} <= {hi:g} s": n - before[a][hi]
        for a in addrs
        for hi, n in looplag_probe.over_bound(a).items()
        if n > before[a][hi]
    }


@pytest.mark.timeout(600)
def test_role_changes_and_a_leader_change_do_not_hold_a_controllers_loop(tmp_path) -> None:
    """The controllers' role-change routes at work, not refused (issue 39): under a push load,
    a drain (copies joining), a server stopped (SIGSTOP: dropped by the primaries of its
    secondary copies, its buckets taken over by their secondaries, then declared dead; each
    step awaited in turn) then resumed, a server stopped in order (its leases released) and
    started again, and the Raft leader killed (a new election; the servers' heartbeats and
    role changes go to the new leader). Every controller's blocked-time histogram, read before and after (the killed leader's
    before it is killed), gains no observation above BOUND, and each role change was
    committed at least once."""
    c = LocalCluster(tmp_path, token=TOKEN, n_controllers=3, n_servers=3, n_buckets=16,
                     controller_opts={**FAST_CONTROLLER_OPTS, "replication": 2,
                                      "server-timeout": SERVER_TIMEOUT},
                     ps_opts={**FAST_PS_OPTS, "max-shard-elems": 1024},
                     env=looplag_probe.ENV)  # fmt: skip
    try:
        c.start(timeout=90)
        lay = Layout([TensorSpec("x", (X_SHARDS * 1024,))], n_buckets=16, max_shard_elems=1024)
        assert lay.buckets_of_tensor("x") == set(range(16)), "x must reach every bucket"
        client = PSClient(ControllerRouting(c.controllers), lay, TOKEN, retry_for=30.0)
        client.create(lay.tensors["x"], init={"kind": "zeros"},
                      optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip
        load = ExactnessLoad(client, lay, "x", threads=2)
        load.start()
        ctl = list(c.controllers)
        time.sleep(1.0)
        before = {a: looplag_probe.over_bound(a) for a in ctl}
        ops0 = committed(ctl)
        view = c.cluster()
        assert view is not None
        drained = min(c.server_ids, key=lambda s: primaries(view, s))
        code, reply = c.drain(drained)
        assert code == 200, reply
        c.wait_drained(drained, timeout=60)
        assert c.undrain(drained)[0] == 200
        view = c.wait_for(
            lambda v: v["under_replicated"] == 0 and not any(b["joining"] for b in v["buckets"]),
            "copies back after the undrain",
            60,
        )
        # Stopped (SIGSTOP): the live primaries drop it from the rounds of a push to every
        # bucket, then its own buckets fail over; resumed, its copies join again. The server
        # stopped is a primary of some buckets and a secondary of others: the most primaries
        # among the servers that are a secondary somewhere (the one with the most primaries
        # may be a secondary nowhere, and no primary would then have it to drop).
        stopped = max(
            (s for s in c.server_ids if secondary_of(view, s)),
            key=lambda s: primaries(view, s),
        )
        assert primaries(view, stopped) and secondary_of(view, stopped), view["buckets"]
        print(f"stopped {stopped}: primary of {primaries(view, stopped)} buckets, a secondary "
              f"of {secondary_of(view, stopped)}")  # fmt: skip
        ops = committed(ctl)
        c.pause(stopped)
        pusher = threading.Thread(
            target=client.push_dense,
            args=("x", np.ones(X_SHARDS * 1024, np.float32)),
            daemon=True,
        )
        pusher.start()
        # In this order, each awaited (not timed): the primaries of its secondary copies drop
        # it (their rounds to it time out: member-timeout), its secondaries take its buckets
        # over once its leases expired (role_change), then the controllers declare it dead
        # (server-timeout, set past its leases: see SERVER_TIMEOUT).
        for op, what in (
            ("drop_secondary", f"a primary dropped {stopped}"),
            ("role_change", f"a secondary took a bucket of {stopped} over"),
            ("declare_dead", f"{stopped} declared dead"),
        ):
            deadline = time.monotonic() + 30
            while committed(ctl).get(op, 0) <= ops.get(op, 0):
                assert time.monotonic() < deadline, f"not within 30 s: {what}"
                time.sleep(0.2)
        c.resume(stopped)
        pusher.join(60)
        c.wait_placed(timeout=60)
        # Stopped in order (SIGTERM): it releases its primary leases; started again, it joins.
        view = c.cluster()
        assert view is not None
        ended = max(c.server_ids, key=lambda s: primaries(view, s))
        c.stop_process(ended)
        # A bucket whose secondary its primary dropped just before (a loaded machine: a round
        # unanswered for member-timeout) has no other caught-up copy: it waits for `ended`'s
        # (its restart offers it), and the others move to their secondaries.
        c.wait_for(
            lambda v: all(
                b["primary"] not in (None, ended) or not b["secondaries"] for b in v["buckets"]
            ),
            f"{ended}'s buckets on other primaries (those with another copy)",
            60,
        )
        c.start_server(c.index_of(ended))
        c.wait_placed(timeout=60)
        # every controller's holds and commits up to the leader's kill (its histogram goes with it)
        held = new_holds(ctl, before)
        done = committed(ctl)
        leader = c.kill_leader()
        assert leader is not None, "no controller leader to kill"
        survivors = [a for i, a in enumerate(ctl) if i != leader]
        before = {a: looplag_probe.over_bound(a) for a in survivors}
        deadline = time.monotonic() + 30
        while c.controller_leader() is None:
            assert time.monotonic() < deadline, "no new leader within 30 s"
            time.sleep(0.2)
        c.wait_placed(timeout=60)
        time.sleep(1.0)
        load.stop()
        assert load.acked_count() > 0
        client.close()
        held.update(new_holds(survivors, before))
    finally:
        c.stop()
    missing = [op for op in ROLE_CHANGES if done.get(op, 0) <= ops0.get(op, 0)]
    assert not missing, f"role changes not exercised: {[(op, ROLE_CHANGES[op]) for op in missing]}"
    assert not held, f"role changes held a controller's loop over {BOUND * 1000:g} ms: {held}"
