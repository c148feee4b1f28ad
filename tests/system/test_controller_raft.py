"""Three real controller processes on loopback: failover, pauses, lost quorum, full restarts,
and lease safety by the controllers' own committed record (Project Adam 3.3.3).

Parameter servers are simulated by `FakeServers`: a thread that registers server ids through the
real HTTP API and heartbeats them, and that keeps, like a real PS, the holder-side view of its
leases (timed from when it *asked*), so that the test can also check that no two holders of a
bucket could write at the same instant.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from adamps.client.controller import ControllerClient
from adamps.core.lease import LeaseTerms, check_history
from adamps.layout import Layout, TensorSpec
from adamps.up.procs import adamps_argv, free_port

TOKEN = "test-token"
TERMS = LeaseTerms(duration=1.0, skew=0.1, margin=0.2)
pytestmark = pytest.mark.slow


def call(
    addr: str,
    method: str,
    path: str,
    body: Any = None,
    token: str | None = TOKEN,
    timeout: float = 5.0,
):
    """(status, JSON body) of one request; (0, None) when the controller cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"null")
    except (urllib.error.URLError, OSError):
        return 0, None


def distinct_ports(k: int) -> list[int]:
    """k free TCP ports, all different (held open together while the kernel picks them)."""
    socks = []
    try:
        for _ in range(k):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class Controllers:
    """N controller processes sharing one member list; each can be killed and restarted."""

    def __init__(self, procs, root: Path, n: int = 3, **opts: Any) -> None:
        self.procs = procs
        self.root = root
        flat = distinct_ports(2 * n)
        ports = list(zip(flat[::2], flat[1::2], strict=True))
        self.members = ",".join(f"127.0.0.1:{rp}:{hp}" for rp, hp in ports)
        self.http = [f"127.0.0.1:{hp}" for _, hp in ports]
        self.opts = {
            "min-servers": 3,
            "lease-duration": TERMS.duration,
            "lease-skew": TERMS.skew,
            "lease-margin": TERMS.margin,
            "heartbeat-interval": 0.2,
            "server-timeout": 1.0,
            "reconcile-interval": 0.1,
            "commit-timeout": 1.5,
            **opts,
        }
        self.proc: list[Any] = [None] * n
        self.starts = [0] * n

    def start(self, i: int) -> None:
        args = [
            "controller",
            "--members",
            self.members,
            "--member",
            str(i),
            "--data-dir",
            str(self.root / f"c{i}"),
        ]
        for k, v in self.opts.items():
            args += [f"--{k}", str(v)]
        self.starts[i] += 1
        self.proc[i] = self.procs.start(f"controller{i}-{self.starts[i]}", *args)

    def start_all(self) -> None:
        for i in range(len(self.http)):
            self.start(i)
        for i in range(len(self.http)):
            self.proc[i].wait_http(f"http://{self.http[i]}/healthz", timeout=20)

    def kill(self, i: int) -> None:
        self.proc[i].kill()

    def status(self, i: int) -> dict[str, Any] | None:
        code, body = call(self.http[i], "GET", "/status", timeout=1.0)
        return body["raft"] if code == 200 else None

    def leader(self, among: list[int] | None = None, timeout: float = 10.0) -> int:
        """Index of the leader once every node in `among` agrees on it."""
        among = list(range(len(self.http))) if among is None else among
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            sts = [self.status(i) for i in among]
            leaders = {s["leader"] for s in sts if s}
            if all(sts) and len(leaders) == 1 and None not in leaders:
                for i, s in zip(among, sts, strict=True):
                    if s["role"] == "leader" and s["ready"]:
                        return i
            time.sleep(0.05)
        raise AssertionError(
            f"no agreed leader among {among} within {timeout}s: {[self.status(i) for i in among]}"
        )

    def write(self, i: int, path: str, body: Any, timeout: float = 10.0) -> dict[str, Any]:
        """A write through node `i`, retried while the cluster answers no_quorum."""
        deadline = time.monotonic() + timeout
        while True:
            code, reply = call(self.http[i], "POST", path, body)
            if code == 200:
                return reply
            if time.monotonic() > deadline:
                raise AssertionError(f"POST {path} via {self.http[i]}: {code} {reply}")
            time.sleep(0.1)


class FakeServers(threading.Thread):
    """Parameter servers that only register and heartbeat, keeping the holder-side lease view."""

    def __init__(self, ctl: Controllers, ids: list[str], interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.ctl = ctl
        self.ids = ids
        self.interval = interval
        self.silent: set[str] = set()
        self.stopped = threading.Event()
        #: (bucket, epoch) -> [holder, first confirmation (monotonic), last deadline]
        self.windows: dict[tuple[int, int], list[Any]] = {}
        self.lock = threading.Lock()
        self.errors: list[str] = []
        #: report joining copies as caught up (what a real PS does after its state transfer)
        self.catch_up = True
        self.catching_up: set[str] = set()

    def register_all(self) -> None:
        for sid in self.ids:
            self.ctl.write(0, f"/servers/{sid}/register", {"address": f"127.0.0.1:{free_port()}"})

    def run(self) -> None:
        # One thread per server, as each PS heartbeats on its own.
        threads = [threading.Thread(target=self.loop, args=(sid,), daemon=True) for sid in self.ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def loop(self, sid: str) -> None:
        first = 0
        while not self.stopped.is_set():
            if sid not in self.silent:
                first = self.beat(sid, first)
            time.sleep(self.interval)

    def beat(self, sid: str, first: int) -> int:
        """One heartbeat, to the controller that answered last time first; returns that one."""
        n = len(self.ctl.http)
        for k in range(n):
            i = (first + k) % n
            addr = self.ctl.http[i]
            asked = time.monotonic()
            code, reply = call(addr, "POST", f"/servers/{sid}/heartbeat", {}, timeout=1.0)
            got = time.monotonic()
            if code == 200:
                with self.lock:
                    for b, epoch in reply["renewed"]:
                        w = self.windows.setdefault((b, epoch), [sid, got, 0.0])
                        assert w[0] == sid
                        w[2] = max(w[2], TERMS.holder_deadline(asked))
                # A real PS would now transfer the joining buckets' state (in the background,
                # heartbeats go on); a fake one has none to transfer.
                joining = [r for r in reply.get("roles", []) if r["role"] == "joining"]
                if joining and self.catch_up and sid not in self.catching_up:
                    self.catching_up.add(sid)
                    threading.Thread(
                        target=self.report_caught_up, args=(sid, addr, joining), daemon=True
                    ).start()
                return i
            if code not in (0, 503):
                self.errors.append(f"{sid} heartbeat via {addr}: {code} {reply}")
                return i
        return first

    def report_caught_up(self, sid: str, addr: str, joining: list[dict[str, Any]]) -> None:
        try:
            for role in joining:
                body = {"server": sid, "primary": role["primary"], "epoch": role["epoch"]}
                call(addr, "POST", f"/buckets/{role['bucket']}/caught-up", body, timeout=1.0)
        finally:
            self.catching_up.discard(sid)

    def overlaps(self) -> list[str]:
        """Pairs of holders of one bucket whose writable windows intersect in real time."""
        by_bucket: dict[int, list[tuple[int, list[Any]]]] = {}
        with self.lock:
            for (b, epoch), w in self.windows.items():
                by_bucket.setdefault(b, []).append((epoch, w))
        bad = []
        for b, ws in by_bucket.items():
            ws.sort()
            for (e1, w1), (e2, w2) in zip(ws, ws[1:], strict=False):
                if w2[1] < w1[2]:
                    bad.append(
                        f"bucket {b}: epoch {e2} ({w2[0]}) writable at {w2[1]:.3f} before epoch {e1} ({w1[0]}) ended {w1[2]:.3f}"
                    )
        return bad

    def stop(self) -> None:
        self.stopped.set()
        self.join(timeout=5)


@pytest.fixture
def ctl(procs, tmp_path: Path) -> Controllers:
    c = Controllers(procs, tmp_path)
    c.start_all()
    c.leader()
    return c


def test_leader_killed_new_leader_fast_nothing_lost_routing_continues(ctl: Controllers) -> None:
    servers = FakeServers(ctl, ["ps0", "ps1", "ps2"])
    servers.register_all()
    servers.start()
    client = None
    try:
        old = ctl.leader()
        follower = next(i for i in range(3) if i != old)
        # Writes through a follower are forwarded; each acknowledged one must survive.
        for k in range(5):
            ctl.write(
                follower,
                "/progress",
                {"epoch": 1, "replica": f"r{k}", "progress": k / 5, "done": False},
            )
        code, routing = call(ctl.http[follower], "GET", "/routing")
        assert code == 200 and all(b["primary"] for b in routing["buckets"])
        before = routing["version"]

        client = ControllerClient(ctl.http, TOKEN, timeout=2.0, retry_for=10.0)
        layout = Layout([TensorSpec("w1", (300, 784)), TensorSpec("b1", (300,))], n_buckets=64)
        assert client.layout() is None
        assert client.set_layout(layout.to_dict())["layout_version"] == 1

        ctl.kill(old)
        t0 = time.monotonic()
        survivors = [i for i in range(3) if i != old]
        routing_ok = 0
        new = None
        while time.monotonic() - t0 < 3.0:
            code, routing = call(ctl.http[survivors[0]], "GET", "/routing", timeout=1.0)
            assert code == 200, f"routing must keep answering during failover: {code} {routing}"
            routing_ok += 1
            sts = [ctl.status(i) for i in survivors]
            if all(sts) and any(s["role"] == "leader" for s in sts):
                new = next(i for i, s in zip(survivors, sts, strict=True) if s["role"] == "leader")
                break
            time.sleep(0.05)
        elapsed = time.monotonic() - t0
        assert new is not None, "no new leader within 3 s of SIGKILL"
        print(f"new leader after {elapsed:.2f}s ({routing_ok} routing answers meanwhile)")

        ctl.write(
            survivors[1],
            "/progress",
            {"epoch": 1, "replica": "after", "progress": 1.0, "done": True},
        )
        for i in survivors:
            deadline = time.monotonic() + 5
            while True:
                code, prog = call(ctl.http[i], "GET", "/progress?epoch=1")
                if code == 200 and len(prog["replicas"]) == 6:
                    break
                assert time.monotonic() < deadline, (
                    f"controller {i} lost committed progress: {prog}"
                )
                time.sleep(0.05)
            code, routing = call(ctl.http[i], "GET", "/routing")
            assert routing["version"] >= before and len(routing["servers"]) == 3
        # The client finds a live controller by itself; the layout survived the failover; it
        # reads its own write (through the controller it wrote through).
        assert client.report_progress(1, "client", 0.5)["ok"]
        got = client.layout()
        assert got["layout_version"] == 1 and Layout.from_dict(got["layout"]) == layout
        assert len(client.progress(1)["replicas"]) == 7
        # Heartbeats carried on through the new leader: nobody was declared dead.
        time.sleep(1.5)
        code, view = call(ctl.http[new], "GET", "/cluster")
        assert {s: r["state"] for s, r in view["servers"].items()} == dict.fromkeys(
            ["ps0", "ps1", "ps2"], "live"
        )
        assert servers.errors == []

        # Bad input: 4xx with a JSON body naming the problem; the controller keeps serving.
        h = ctl.http[new]
        assert call(h, "POST", "/rebalance", token=None)[1]["error"]["code"] == "unauthorized"
        assert call(h, "POST", "/rebalance", token="wrong")[0] == 401
        assert call(h, "POST", "/servers/ps9/heartbeat", {})[1]["error"]["code"] == "not_found"
        assert call(h, "POST", "/servers/bad%20id!/register", {"address": "x"})[0] == 400
        assert call(h, "POST", "/servers/ps0/register", {})[1]["error"]["code"] == "bad_request"
        assert (
            call(h, "POST", "/buckets/999/role-change", {})[1]["error"]["code"] == "unknown_bucket"
        )
        code, err = call(h, "POST", "/buckets/0/role-change", {"server": "ps1", "prev_epoch": 99})
        assert code == 409 and err["error"]["code"] in ("stale_epoch", "conflict")
        assert call(h, "POST", "/progress", {"epoch": "x", "replica": "r"})[0] == 400
        assert (
            call(h, "PUT", "/layout", {"n_buckets": 3, "tensors": []})[1]["error"]["code"]
            == "conflict"
        )
        assert call(h, "PUT", "/layout", {"tensors": 5})[0] == 400
        assert call(h, "GET", "/healthz")[0] == 200
    finally:
        servers.stop()
        if client is not None:
            client.close()


def test_follower_paused_cluster_commits_and_it_catches_up(procs, tmp_path: Path) -> None:
    # Compaction after 10 entries: while the follower is paused the others compact their logs,
    # so it catches up from a transferred full dump, not from log entries alone.
    ctl = Controllers(procs, tmp_path, **{"compaction-entries": 10})
    ctl.start_all()
    leader = ctl.leader()
    paused = next(i for i in range(3) if i != leader)
    ctl.proc[paused].signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        for k in range(20):
            ctl.write(
                leader,
                "/progress",
                {"epoch": 2, "replica": f"r{k}", "progress": 0.5, "done": False},
                timeout=3,
            )
        assert time.monotonic() - t0 < 5.0, (
            "the majority keeps committing while a follower is paused"
        )
        deadline = time.monotonic() + 10
        while not (tmp_path / f"c{leader}" / "raft.dump").exists():
            assert time.monotonic() < deadline, "the leader did not compact its log"
            time.sleep(0.1)
    finally:
        ctl.proc[paused].signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while True:
        code, prog = call(ctl.http[paused], "GET", "/progress?epoch=2")
        lead, mine = ctl.status(leader), ctl.status(paused)
        if (
            code == 200
            and len(prog["replicas"]) == 20
            and mine
            and lead
            and mine["commit_index"] >= lead["commit_index"] - 1
        ):
            break
        assert time.monotonic() < deadline, (
            f"paused follower did not catch up: {prog} {mine} {lead}"
        )
        time.sleep(0.1)


def test_two_of_three_killed_writes_refused_then_resume(ctl: Controllers) -> None:
    leader = ctl.leader()
    others = [i for i in range(3) if i != leader]
    for i in others:
        ctl.kill(i)
    body = {"epoch": 3, "replica": "r", "progress": 0.1, "done": False}
    for _ in range(3):
        t0 = time.monotonic()
        code, reply = call(ctl.http[leader], "POST", "/progress", body, timeout=10)
        took = time.monotonic() - t0
        assert code == 503 and reply["error"]["code"] == "no_quorum", (code, reply)
        assert took < 2.5, f"no_quorum must come fast, took {took:.2f}s"
        time.sleep(0.5)
    # Reads still answer from the surviving node's state.
    assert call(ctl.http[leader], "GET", "/routing")[0] == 200
    ctl.start(others[0])
    ctl.proc[others[0]].wait_http(f"http://{ctl.http[others[0]]}/healthz", timeout=20)
    reply = ctl.write(others[0], "/progress", body, timeout=10)
    assert reply["ok"]

    # Now the survivor is a follower whose leader is gone: it fails fast too, then resumes.
    leader = ctl.leader([leader, others[0]])
    survivor = next(i for i in (leader, others[0]) if i != leader)
    ctl.kill(leader)
    for _ in range(3):
        t0 = time.monotonic()
        code, reply = call(ctl.http[survivor], "POST", "/progress", body, timeout=10)
        took = time.monotonic() - t0
        assert code == 503 and reply["error"]["code"] == "no_quorum", (code, reply)
        assert took < 2.5, f"no_quorum must come fast, took {took:.2f}s"
        time.sleep(0.3)
    ctl.start(others[1])
    reply = ctl.write(survivor, "/progress", {**body, "replica": "r2"}, timeout=15)
    assert reply["ok"]


def test_full_restart_keeps_configuration_also_after_compaction(procs, tmp_path: Path) -> None:
    # A long server timeout: nothing may change while the fake servers are silent.
    c = Controllers(procs, tmp_path, **{"server-timeout": 60.0, "compaction-entries": 25})
    c.start_all()
    c.leader()
    servers = FakeServers(c, ["ps0", "ps1", "ps2", "ps3"])
    servers.register_all()
    c.write(0, "/servers/ps3/drain", {})

    def snapshot(i: int) -> dict[str, Any]:
        code, view = call(c.http[i], "GET", "/cluster")
        assert code == 200
        code, prog = call(c.http[i], "GET", "/progress")
        return {
            "servers": {
                s: (r["state"], r["incarnation"], r["address"]) for s, r in view["servers"].items()
            },
            "buckets": [
                (b["primary"], b["epoch"], b["secondaries"], b["joining"], b["want"])
                for b in view["buckets"]
            ],
            "progress": prog["epochs"],
        }

    def restart_all_and_compare(expect: dict[str, Any]) -> None:
        for i in range(3):
            c.kill(i)
        c.start_all()
        c.leader()
        for i in range(3):
            deadline = time.monotonic() + 10
            while snapshot(i) != expect:
                assert time.monotonic() < deadline, (
                    f"controller {i} after restart:\n{snapshot(i)}\n!=\n{expect}"
                )
                time.sleep(0.1)

    # 1) journal only (no compaction yet)
    for k in range(3):
        c.write(
            k % 3, "/progress", {"epoch": 4, "replica": f"r{k}", "progress": k / 10, "done": False}
        )
    leader = c.leader()
    time.sleep(1.2)  # the commit index reaches the journal's meta file once per second
    expect = snapshot(leader)
    assert not any((tmp_path / f"c{i}" / "raft.dump").exists() for i in range(3))
    restart_all_and_compare(expect)

    # 2) enough entries for a log compaction (full dump) on every node, then a few more
    for k in range(40):
        c.write(
            k % 3,
            "/progress",
            # progress is the fraction of the epoch done: in [0, 1]
            {"epoch": 5, "replica": f"r{k % 7}", "progress": k / 40, "done": k > 30},
        )
    deadline = time.monotonic() + 10
    while not all((tmp_path / f"c{i}" / "raft.dump").exists() for i in range(3)):
        assert time.monotonic() < deadline, "no full dump written"
        time.sleep(0.1)
    c.write(0, "/progress", {"epoch": 6, "replica": "last", "progress": 1, "done": True})
    leader = c.leader()
    time.sleep(1.2)
    expect = snapshot(leader)
    assert expect["progress"]["6"]["last"]["done"] is True
    restart_all_and_compare(expect)
    # And the restarted cluster keeps working.
    c.write(2, "/progress", {"epoch": 7, "replica": "again", "progress": 1, "done": True})


def test_lease_safety_across_leader_changes_and_server_failures(procs, tmp_path: Path) -> None:
    ctl = Controllers(procs, tmp_path, **{"server-timeout": 2.0})
    ctl.start_all()
    ctl.leader()
    servers = FakeServers(ctl, ["ps0", "ps1", "ps2", "ps3"])
    servers.register_all()
    servers.start()
    try:
        # Let the 4th server's copies catch up (the fake servers report it on their heartbeats).
        deadline = time.monotonic() + 10
        while call(ctl.http[0], "GET", "/cluster")[1]["under_replicated"] > 0:
            assert time.monotonic() < deadline, "copies did not catch up"
            time.sleep(0.1)
        # A primary fails: the controller declares it dead and promotes after its lease expired.
        servers.silent.add("ps1")
        time.sleep(0.6)
        ctl.kill(ctl.leader())  # ... and the controller leader dies in the middle of it
        alive = [i for i in range(3) if ctl.proc[i].alive]
        leader = ctl.leader(alive)

        def wait_cluster(pred, what: str, timeout: float = 10.0) -> dict[str, Any]:
            deadline = time.monotonic() + timeout
            while True:
                code, view = call(ctl.http[leader], "GET", "/cluster")
                if code == 200 and pred(view):
                    return view
                assert time.monotonic() < deadline, f"{what}: {view and view['servers']}"
                time.sleep(0.1)

        wait_cluster(
            lambda v: (
                v["servers"]["ps1"]["state"] == "dead"
                and all(b["primary"] not in (None, "ps1") for b in v["buckets"])
            ),
            "ps1 declared dead and its buckets re-granted",
        )
        # Another server fails, then one is drained: more grants and hand-offs in the record.
        # Another primary fails; its secondaries propose role changes (Adam 3.3.3), refused
        # while its lease may be in use, accepted (or overtaken by the controller) after.
        # A victim whose lease was just renewed, so the refusal below does not depend on how
        # late the heartbeats run on a loaded machine (the lease lasts only 1 s here).
        deadline = time.monotonic() + 10
        while True:
            code, view = call(ctl.http[leader], "GET", "/cluster")
            victim = next(
                (
                    b
                    for b in view["buckets"]
                    if b["primary"] == "ps2" == b["want"][0]
                    and b["secondaries"]
                    and b["lease"]["expires_at"] - view["clock"] > 0.9
                ),
                None,
            )
            if victim is not None:
                break
            assert time.monotonic() < deadline, "no freshly renewed lease of ps2"
            time.sleep(0.02)
        servers.silent.add("ps2")
        proposal = {"server": victim["secondaries"][0], "prev_epoch": victim["epoch"]}
        path = f"/buckets/{victim['bucket']}/role-change"
        code, reply = call(ctl.http[leader], "POST", path, proposal)
        assert code == 409 and reply["error"].get("reason") == "lease_active", reply
        assert reply["error"]["retry_after"] > 0
        deadline = time.monotonic() + 10
        while True:
            code, reply = call(ctl.http[leader], "POST", path, proposal)
            if code == 200 or (code == 409 and reply["error"]["code"] == "stale_epoch"):
                break
            assert time.monotonic() < deadline, reply
            time.sleep(0.1)
        if code == 200:
            assert (
                reply["epoch"] == victim["epoch"] + 1 and reply["primary"] in victim["secondaries"]
            )
        wait_cluster(
            lambda v: all(b["primary"] not in (None, "ps1", "ps2") for b in v["buckets"]),
            "ps2's buckets re-granted",
        )
        ctl.write(leader, "/servers/ps3/drain", {})
        wait_cluster(
            lambda v: (
                all(b["primary"] == "ps0" for b in v["buckets"])
                and v["servers"]["ps3"]["state"] == "drained"
            ),  # also after the drain's hold
            "ps3 drained",
        )
        code, record = call(ctl.http[leader], "GET", "/leases")
        assert code == 200
        assert check_history(record["records"], TERMS) == []
        epochs = [r["epoch"] for r in record["records"]]
        assert max(epochs) >= 2, "the history exercised re-grants"
        assert servers.overlaps() == []
        assert servers.errors == []

        # `adamps status` prints it as tables, also with one controller down.
        out = subprocess.run(
            adamps_argv("status", "--controllers", ",".join(ctl.http), "--buckets"),
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        assert "unreachable" in out and "leader" in out
        lines = {
            line.split()[0]: line.split() for line in out.splitlines() if line.startswith("ps")
        }
        head = next(line.split() for line in out.splitlines() if line.startswith("server"))
        state, primary = head.index("state"), head.index("primary")  # by name: columns grow
        assert (
            lines["ps1"][state] == "dead"
            and lines["ps3"][state] == "drained"
            and lines["ps0"][primary] == "64"
        ), out
    finally:
        servers.stop()
