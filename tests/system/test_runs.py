"""Issue 25's runs on a real cluster: 3 controllers (Raft), 3 parameter servers (replicated
buckets, LMDB), a data server, `adamps run` and `adamps train` as processes.

- Isolation: two runs whose layers have the same names train at the same time, each with its own
  token, and end with different weights, each its own; one run's token on the other's tensors
  gets 403 naming its namespace; a run's token cannot call admin endpoints.
- Quotas: parameter elements and table rows at create (403 quota_exceeded), push bytes per
  second (429 rate_limited with Retry-After; the client backs off and its pushes all land); the
  run keeps its data.
- Delete: the run's tensors leave the servers' memory, metrics and LMDB, and the layout.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError
from adamps.layout import Layout, TensorSpec
from adamps.server.storage.persist import Persister
from adamps.up.cluster import FAST_CONTROLLER_OPTS, FAST_PS_OPTS, LocalCluster
from adamps.up.procs import adamps_argv
from adamps.wire import protocol
from tests.polling import wait_for
from trainer import export

pytestmark = pytest.mark.slow

TOKEN = "test-token-of-the-runs-cluster"
N_BUCKETS = 8


def cluster(root: Path) -> LocalCluster:
    c = LocalCluster(
        root,
        token=TOKEN,
        n_servers=3,
        n_buckets=N_BUCKETS,
        controller_opts=FAST_CONTROLLER_OPTS,
        ps_opts=FAST_PS_OPTS,
    )
    c.start(timeout=60)
    return c


def adamps_run(c: LocalCluster, *args: str) -> subprocess.CompletedProcess:
    env = {**c.env, "PATH": "/usr/bin:/bin"}
    argv = adamps_argv("run", *args, "--controllers", ",".join(c.controllers))
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env)


def create_run(c: LocalCluster, name: str, tmp: Path, *quotas: str) -> str:
    token_file = tmp / f"{name}.token"
    out = adamps_run(c, "create", name, "--token-file", str(token_file), *quotas)
    assert out.returncode == 0, out.stderr
    token = token_file.read_text().strip()
    assert token in out.stdout  # shown once, at create
    assert token_file.stat().st_mode & 0o777 == 0o600
    return token


def http(
    addr: str, method: str, path: str, token: str, body: bytes = b"", msgpack: bool = False
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, decoded body) of a raw request."""
    headers = {"Authorization": f"Bearer {token}"}
    headers["Content-Type"] = "application/msgpack" if msgpack else "application/json"
    req = urllib.request.Request(f"http://{addr}{path}", data=body or None, method=method)
    for k, v in headers.items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, hdrs, data = resp.status, dict(resp.headers), resp.read()
    except urllib.error.HTTPError as exc:
        status, hdrs, data = exc.code, dict(exc.headers), exc.read()
    try:
        decoded = json.loads(data) if data[:1] in (b"{", b"[") else protocol.decode(data)
    except Exception:
        decoded = {"raw": data[:200]}
    if isinstance(decoded, dict) and isinstance(decoded.get("error"), dict):
        decoded = decoded["error"]  # an error reply: its code, message and extra fields
    return status, hdrs, decoded


def rpc(addr: str, token: str, op: str, **fields: Any) -> tuple[int, dict[str, str], Any]:
    body = protocol.encode(protocol.request(op, **fields))
    return http(addr, "POST", "/rpc", token, body, msgpack=True)


def metric(addr: str, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith(name + labels + " ") or (not labels and line.startswith(name + " ")):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.timeout(420)
def test_two_runs_with_the_same_layer_names_train_apart(tmp_path: Path) -> None:
    c = cluster(tmp_path / "cluster")
    try:
        ta = create_run(c, "alpha", tmp_path)
        tb = create_run(c, "beta", tmp_path)
        listed = adamps_run(c, "list")
        assert listed.returncode == 0 and "alpha" in listed.stdout and "beta" in listed.stdout
        # The data server takes runs' tokens too (it learns them from the controllers).
        ds = c.start_dataserver("--no-augment", "--controllers", ",".join(c.controllers))
        c.procs["dataserver0"].wait_http(f"http://{ds}/healthz", 60)

        def train(run: str, seed: int) -> Any:
            return c.start_process(
                f"train-{run}", "train", "--controllers", ",".join(c.controllers),
                "--dataservers", f"http://{ds}", "--run", run,
                "--token-file", str(tmp_path / f"{run}.token"), "--seed", str(seed),
                "--epochs", "1", "--warm-start", "20", "--metrics-port", "-1",
                "--out", str(tmp_path / f"{run}.npz"),
            )  # fmt: skip

        a, b = train("alpha", 1), train("beta", 2)
        assert a.popen.wait(300) == 0, a.tail(40)
        assert b.popen.wait(120) == 0, b.tail(40)

        # Each run's weights are its own: in its namespace on the servers, equal to its export.
        layout = Layout.from_dict(
            json.loads(urllib.request.urlopen(f"http://{c.controllers[0]}/layout").read())["layout"]
        )
        names = set(layout.tensors)
        assert "alpha..fc1.w" in names and "beta..fc1.w" in names, names
        assert not [n for n in names if not n.startswith(("alpha..", "beta.."))], names
        model_a, _ = export.load(tmp_path / "alpha.npz")
        model_b, _ = export.load(tmp_path / "beta.npz")
        wa, wb = model_a.param("alpha..fc1.w"), model_b.param("beta..fc1.w")
        assert wa.shape == wb.shape and not np.allclose(wa, wb)
        specs = [layout.tensors[n] for n in ("alpha..fc1.w", "beta..fc1.w")]
        with PSClient(
            ControllerRouting(c.controllers), Layout(specs, N_BUCKETS), ta, retry_for=20
        ) as ca:
            got_a = ca.pull(["alpha..fc1.w"])[0]["alpha..fc1.w"]
            np.testing.assert_allclose(got_a, wa, rtol=1e-6, atol=1e-6)
            # alpha's token on beta's tensor: 403 naming alpha's namespace, over the client too
            with pytest.raises(RpcError) as refused:
                ca.pull(["beta..fc1.w"])
            assert refused.value.code == "forbidden" and "'alpha..'" in refused.value.message

        # Raw, on every server: pull and push of beta's tensor with alpha's token.
        for addr in c.servers:
            status, _, body = rpc(addr, ta, "pull", tensors=["beta..fc1.w"])
            assert status == 403 and body["code"] == "forbidden", body
            assert body["namespace"] == "alpha.." and "beta..fc1.w" in body["message"]
            delta = np.zeros(specs[1].shape, np.float32)
            status, _, body = rpc(addr, ta, "push_dense", tensor="beta..fc1.w", delta=delta)
            assert status == 403 and body["namespace"] == "alpha.."
            # `list` shows a run its own tensors only
            status, _, body = rpc(addr, ta, "list")
            listed = {t["name"] for t in body["tensors"]}
            assert status == 200 and "alpha..fc1.w" in listed, body
            assert all(n.startswith("alpha..") for n in listed), listed
            # a replication op or a flush is the operator's
            status, _, body = rpc(addr, ta, "flush")
            assert status == 403 and body["code"] == "forbidden"
            status, _, body = http(addr, "POST", "/flush", ta)  # was 401 (issue 39 #14)
            assert status == 403 and body["code"] == "forbidden" and "'alpha'" in str(body)
            # an unknown token is no run's
            status, _, body = rpc(addr, ta + "x", "pull", tensors=["alpha..fc1.w"])
            assert status == 401
        # beta's weights are untouched by alpha's attempts, and its own token reads them
        with PSClient(
            ControllerRouting(c.controllers), Layout(specs, N_BUCKETS), tb, retry_for=20
        ) as cb:
            got_b = cb.pull(["beta..fc1.w"])[0]["beta..fc1.w"]
            np.testing.assert_allclose(got_b, wb, rtol=1e-6, atol=1e-6)

        # On the data server, a run's token leases only its own run's slices (elastic replicas)
        body = protocol.encode(protocol.request("lease", run="beta", replica="r9", epochs=1))
        status, _, reply = http(ds, "POST", "/lease", ta, body, msgpack=True)
        assert status == 403 and reply["code"] == "forbidden" and "'beta'" in reply["message"]
        # A run's token calls no admin endpoint on the controllers.
        ctl = c.controllers[1]
        for method, path, body in [
            ("POST", "/buckets/0/declare-lost", b"{}"),
            ("POST", "/servers/ps0/drain", b"{}"),
            ("POST", "/rebalance", b"{}"),
            ("POST", "/runs", json.dumps({"name": "gamma"}).encode()),
            ("DELETE", "/runs/beta", b""),
            ("GET", "/auth/runs", b""),  # was 401 "wrong cluster token" (issue 39 #14)
        ]:
            status, _, reply = http(ctl, method, path, ta, body)
            assert status == 403, (path, reply)
            assert reply["code"] == "forbidden" and "alpha" in reply["message"], reply
        # ... nor reports another run's progress
        prog = json.dumps({"epoch": 1, "replica": "beta/0", "progress": 1.0, "done": True})
        status, _, reply = http(ctl, "POST", "/progress", ta, prog.encode())
        assert status == 403 and reply["namespace"] == "alpha/"
        # `adamps status` shows each run: its tensors, elements, bytes held and pushed
        st = subprocess.run(
            adamps_argv("status", "--controllers", ",".join(c.controllers)),
            capture_output=True, text=True, timeout=60, env={**c.env, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert st.returncode == 0, st.stderr
        rows = {ln.split()[0]: ln.split() for ln in st.stdout.splitlines() if ln.strip()}
        n_alpha = len([n for n in names if n.startswith("alpha..")])
        elems = sum(layout.tensors[n].size for n in names if n.startswith("alpha.."))
        assert rows["alpha"][1:3] == [str(n_alpha), str(elems)], st.stdout
        assert int(rows["alpha"][3]) >= 4 * elems and int(rows["alpha"][4]) > 0, st.stdout
        assert "beta" in rows, st.stdout
        shown = adamps_run(c, "show", "beta")
        assert shown.returncode == 0 and "beta.." in shown.stdout and tb not in shown.stdout
    finally:
        c.stop()


@pytest.mark.timeout(240)
def test_quotas_refuse_with_their_code_and_delete_frees_the_run(tmp_path: Path) -> None:
    c = cluster(tmp_path / "cluster")
    try:
        tq = create_run(
            c, "q", tmp_path,
            "--param-elems", "1000", "--table-rows", "100", "--push-bytes-per-s", "20000",
        )  # fmt: skip
        w, v = TensorSpec("q..w", (600,)), TensorSpec("q..v", (600,))
        routing = ControllerRouting(c.controllers)
        client = PSClient(routing, Layout([w], N_BUCKETS), tq, retry_for=30, data_plane=False)
        client.create(w, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": -1.0})
        client.push_dense("q..w", np.ones(600, np.float32))

        # Parameter elements, at create: 403 quota_exceeded naming the quota; nothing created.
        with pytest.raises(RpcError) as over:
            client.create(v, init={"kind": "zeros"})
        assert over.value.code == "quota_exceeded" and over.value.http_status == 403
        assert over.value.extra["quota"] == "param_elems" and "param_elems" in str(over.value)
        # and in a layout set at the controllers
        big = Layout([TensorSpec("q..w", (2000,))], N_BUCKETS).to_dict()
        status, _, reply = http(
            c.controllers[0], "POST", "/layout", tq, json.dumps({"layout": big}).encode()
        )
        assert status == 403 and reply["code"] == "quota_exceeded", reply
        assert reply["quota"] == "param_elems"
        # and a trainer of the run whose model is over it: one line naming the quota, exit 1
        # (a traceback buried the message)
        train = subprocess.run(
            adamps_argv("train", "--controllers", ",".join(c.controllers), "--run", "q",
                        "--token-file", str(tmp_path / "q.token"), "--epochs", "1",
                        "--metrics-port", "-1", "--dataservers", "http://127.0.0.1:1"),
            capture_output=True, text=True, timeout=120, env={**c.env, "PATH": "/usr/bin:/bin"},
        )  # fmt: skip
        assert train.returncode == 1, train.stderr[-2000:]
        assert "quota_exceeded" in train.stderr and "param_elems" in train.stderr, train.stderr
        assert "Traceback" not in train.stderr, train.stderr[-2000:]
        # The consistency modes' step clocks: its own run's, not another's (a run token could
        # not train under ssp or sync at all: `clock` was the operator's)
        clock = {"replica": "0", "mode": "ssp:1", "step": 0, "wait": 0.0}
        status, _, reply = rpc(c.servers[0], tq, "clock", run="q", **clock)
        assert status == 200, reply
        status, _, reply = rpc(c.servers[0], tq, "clock", run="other", **clock)
        assert status == 403 and reply["code"] == "forbidden" and "'q'" in str(reply), reply

        # Table rows, at create: a table's max_rows counts against the quota.
        adm = {"max_rows": 80}
        for addr in c.servers:
            status, _, reply = rpc(addr, tq, "create_table", name="q..t", dim=4, admission=adm)
            assert status == 200, reply
        status, _, reply = rpc(
            c.servers[0], tq, "create_table", name="q..u", dim=4, admission={"max_rows": 40}
        )
        assert (
            status == 403 and reply["code"] == "quota_exceeded" and reply["quota"] == "table_rows"
        )

        # Push bytes per second: raw pushes past it get 429 with Retry-After, nothing applied.
        shard = client.layout.shards_of["q..w"][0]
        route = client.routing().routes[client.layout.bucket_of[shard.id]]
        addr = route.primary.split("://", 1)[-1]
        limited = None
        for _ in range(40):
            status, headers, reply = rpc(
                addr, tq, "push_dense", shards={shard.id: np.zeros(shard.size, np.float32)}
            )
            if status == 429:
                limited = (headers, reply)
                break
            assert status == 200, reply
        assert limited is not None, "40 pushes of ~2.5 kB each within a 20 kB/s quota"
        headers, reply = limited
        assert reply["code"] == "rate_limited" and reply["quota"] == "push_bytes_per_s"
        assert int(headers["Retry-After"]) >= 1 and reply["retry_after"] > 0
        # The client backs off and retries: 30 pushes of 2.4 kB (72 kB at 20 kB/s) all land once.
        t0 = time.monotonic()
        for _ in range(30):
            client.push_dense("q..w", np.ones(600, np.float32))
        assert time.monotonic() - t0 > 2.0  # held to the quota
        got = client.pull(["q..w"])[0]["q..w"]
        np.testing.assert_array_equal(got, np.full(600, 31, np.float32))  # the run kept its data
        client.close()

        # Delete: the run's tensors leave the layout, the servers' memory and metrics, LMDB.
        for addr in c.servers:
            http(addr, "POST", "/flush", TOKEN)
        before = [metric(a, "adamps_run_param_elems", '{run="q"}') for a in c.servers]
        assert all(x == 600 for x in before), before
        out = adamps_run(c, "delete", "q")
        assert out.returncode == 0, out.stderr
        for addr in c.servers:
            wait_for(
                lambda addr=addr: (
                    "q..w"
                    not in json.loads(urllib.request.urlopen(f"http://{addr}/status").read())[
                        "tensors"
                    ]
                ),
                20,
                f"{addr} drops run q's tensors",
            )
            assert metric(addr, "adamps_run_param_elems", '{run="q"}') == 0
            assert metric(addr, "adamps_ps_tensors") == 0
            http(addr, "POST", "/flush", TOKEN)
        assert adamps_run(c, "show", "q").returncode == 1
        status, _, _ = rpc(c.servers[0], tq, "pull", tensors=["q..w"])
        assert status == 401  # the deleted run's token is no token any more
        # the log says so
        logs = "".join(
            (tmp_path / "cluster" / "logs" / f"{s}.log").read_text() for s in c.server_ids
        )
        assert "run q was deleted" in logs
    finally:
        c.stop()
    # Stopped (its final flush done): no LMDB of any server holds a record of run q.
    for sid in c.server_ids:
        p = Persister(tmp_path / "cluster" / sid, 1 << 26, sync=False)
        try:
            left = [s.meta["spec"]["name"] for s in p.load() if "spec" in s.meta]
            with p.env.begin() as txn:
                shards = [bytes(k) for k, _ in txn.cursor(db=p.env.open_db(b"shards", txn=txn))]
        finally:
            p.close()
        assert not [n for n in left if n.startswith("q..")], left
        assert not [k for k in shards if k.startswith(b"q..")], shards


@pytest.mark.timeout(300)
def test_size_quotas_hold_across_the_servers(tmp_path: Path) -> None:
    """Issue 39, finding 8: a run with a 1,000-element quota created a different 1,000-element
    tensor on each of 3 servers (each checked only its own definitions). Now the server asks
    the controllers before it creates a run's tensor or table, and they hold the run's total
    across the cluster against its quotas; the same definition on every server is one use. A
    table's frequency sketches count in memory_bytes (16 x filter_width per bucket)."""
    c = cluster(tmp_path / "cluster")
    try:
        tz = create_run(c, "z", tmp_path, "--param-elems", "1000", "--memory-bytes", "100000")
        first, second, third = c.servers
        status, _, reply = rpc(first, tz, "create", name="z..a", shape=[1000])
        assert status == 200, reply
        for addr in (second, third):  # another tensor elsewhere: past the run's quota
            status, _, reply = rpc(addr, tz, "create", name="z..b", shape=[1000])
            assert status == 403 and reply["code"] == "quota_exceeded", reply
            assert reply["quota"] == "param_elems" and "across the cluster" in reply["message"]
        for addr in c.servers:  # the same definition on every server is one use
            status, _, reply = rpc(addr, tz, "create", name="z..a", shape=[1000])
            assert status == 200, reply
        wide = {"max_rows": 50, "admit_after": 2, "filter_width": 4096}  # 512 KiB of sketches
        status, _, reply = rpc(second, tz, "create_table", name="z..t", dim=4, admission=wide)
        assert status == 403 and reply["quota"] == "memory_bytes", reply
        status, _, reply = rpc(second, tz, "create_table", name="z..u", dim=4,
                               admission={"max_rows": 50})  # fmt: skip
        assert status == 200, reply
        status, _, reply = rpc(third, tz, "list")
        assert [t["name"] for t in reply["tensors"]] == ["z..a"]  # z..b exists nowhere
        status, _, reply = rpc(third, tz, "create_table", name="z..v", dim=4,
                               admission={"max_rows": 10}, init={"kind": "bogus"})  # fmt: skip
        assert status == 400 and reply["code"] == "bad_request", reply  # and not counted:
        show = adamps_run(c, "show", "z", "--json")
        assert show.returncode == 0, show.stderr
        usage = json.loads(show.stdout)["usage"]
        assert usage == {"param_elems": 1000, "table_rows": 50, "memory_bytes": 4000 + 50 * 32}
    finally:
        c.stop()
