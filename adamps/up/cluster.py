"""A cluster of real adamps processes on loopback: used by `adamps up` and by the system tests.

Every role is started the way a user starts it (`adamps controller|ps|dataserver|train ...`), each
process with its log file under the run directory, its data (Raft journal, LMDB) beside it. The
cluster object knows the addresses and can kill, pause and restart members for fault tests.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from adamps.client.rpc import http_json  # noqa: F401  (re-exported: the tests use it from here)
from adamps.security import peer_auth, tls_certs
from adamps.security import tls as tls_mod
from adamps.up.procs import Proc, adamps_argv, free_port, stop_together

#: Timings of the fault tests and benchmarks: 2 s leases, a silent server declared dead after
#: 1 s, a silent primary replaced after 1.5 s, so a failover completes in about 2.5 s.
FAST_LEASE = 2.0
FAST_CONTROLLER_OPTS: dict[str, Any] = {
    "lease-duration": FAST_LEASE, "lease-skew": 0.1, "lease-margin": 0.2, "heartbeat-interval": 0.2,
    "server-timeout": 1.0, "reconcile-interval": 0.1, "commit-timeout": 1.5,
    "election-min": 0.3, "election-max": 0.9,  # a failover well inside the short leases
}  # fmt: skip
FAST_PS_OPTS: dict[str, Any] = {
    "member-timeout": 0.5, "ping-interval": 0.2, "failover-after": 1.5, "flush-interval": 0.5,
}  # fmt: skip


class LocalCluster:
    """Controllers, parameter servers and data servers as local processes."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        token: str,
        n_controllers: int = 3,
        n_servers: int = 3,
        n_buckets: int = 64,
        controller_opts: Mapping[str, Any] | None = None,
        ps_opts: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        port_alloc: Callable[[], int] = free_port,
        host_of: Callable[[str], str] | None = None,
        wrap: Callable[[str, list[str]], list[str]] | None = None,
        data_plane: bool = True,
        peer_token: str | None = None,
        tls: bool = False,
        tls_mutual: bool = False,
        racks: Sequence[str] | None = None,
    ) -> None:
        self.root = Path(root)
        #: server i's rack (issue 26), passed as --rack; None: no racks
        self.racks = list(racks) if racks is not None else None
        #: where every port of this cluster comes from (`adamps up --port-base` counts up)
        self.port_alloc = port_alloc
        self.root.mkdir(parents=True, exist_ok=True)
        #: process name -> the address it binds and is reached at (tests with one network
        #: namespace per process); loopback by default
        self.host_of = host_of or (lambda _name: "127.0.0.1")
        #: process name, argv -> the argv that starts it (e.g. inside its namespace)
        self.wrap = wrap or (lambda _name, argv: argv)
        self.token = token
        #: the controllers' peer secret (adamps.security.peer_auth): generated per cluster unless given;
        #: "" = peer identity off. Only controllers get it; each server gets its own key;
        #: trainers (start_process) get neither.
        self.peer_token = secrets.token_hex(32) if peer_token is None else peer_token
        self.n_buckets = n_buckets
        self.env = {"ADAMPS_TOKEN": token, "OPENBLAS_NUM_THREADS": "1", **(env or {})}
        #: the cluster's throwaway CA and certificate (adamps.security.tls_certs) when TLS is on: every
        #: process gets them through $ADAMPS_TLS_*, and this process (which probes and drives
        #: the cluster, and builds the tests' clients) speaks TLS until stop()
        self.tls_files: tls_certs.CertFiles | None = None
        self._tls_before: tls_mod.TlsConfig | None = None
        if tls:
            self.tls_files = tls_certs.write_ca_and_cert(self.root)
            tls_env = self.tls_files.env(mutual=tls_mutual)
            self.env.update(tls_env)
            self._tls_before = tls_mod.current()
            tls_mod.install(tls_mod.load(environ=tls_env))
        ports = [(port_alloc(), port_alloc()) for _ in range(n_controllers)]
        hosts = [self.host_of(f"controller{i}") for i in range(n_controllers)]
        self.members = ",".join(f"{h}:{rp}:{hp}" for h, (rp, hp) in zip(hosts, ports, strict=True))
        #: controller HTTP addresses (host:port)
        self.controllers = [f"{h}:{hp}" for h, (_, hp) in zip(hosts, ports, strict=True)]
        self.controller_opts = {
            "min-servers": min(3, n_servers),
            "n-buckets": n_buckets,
            **(controller_opts or {}),
        }
        self.ps_opts = dict(ps_opts or {})
        #: parameter server ids and HTTP addresses
        self.server_ids = [f"ps{i}" for i in range(n_servers)]
        self.servers = [f"{self.host_of(s)}:{port_alloc()}" for s in self.server_ids]
        #: whether servers get a data port (clients pull and push over it; else HTTP only)
        self.data_plane = data_plane
        #: each server's data port (0: none), kept across restarts like its HTTP port
        self.data_ports = [port_alloc() if data_plane else 0 for _ in self.server_ids]
        self.dataservers: list[str] = []
        self.procs: dict[str, Proc] = {}
        self._starts: dict[str, int] = {}

    # -- processes ---------------------------------------------------------------------------------

    def _start(self, name: str, *args: str, secret: Mapping[str, str] | None = None) -> Proc:
        self._starts[name] = self._starts.get(name, 0) + 1
        log = self.root / "logs" / f"{name}.log"
        env = {**self.env, **(secret or {})}
        proc = Proc(self.wrap(name, adamps_argv(*args)), log, env=env, name=name)
        self.procs[name] = proc
        return proc

    def start_process(self, name: str, *args: str) -> Proc:
        """Starts `adamps ARGS...` (e.g. a trainer) as a member of this cluster: its log under
        root/logs, the cluster's environment, stopped by stop()."""
        return self._start(name, *args)

    @staticmethod
    def _flags(opts: Mapping[str, Any]) -> list[str]:
        out: list[str] = []
        for k, v in opts.items():
            out += [f"--{k}", ",".join(map(str, v)) if isinstance(v, list | tuple) else str(v)]
        return out

    def start_controller(self, i: int) -> Proc:
        return self._start(
            f"controller{i}",
            "controller", "--members", self.members, "--member", str(i),
            "--data-dir", str(self.root / f"controller{i}"), *self._flags(self.controller_opts),
            secret={"ADAMPS_PEER_TOKEN": self.peer_token} if self.peer_token else None,
        )  # fmt: skip

    def server_key(self, i: int) -> str:
        """Server i's own peer key (hex; "" when peer identity is off)."""
        if not self.peer_token:
            return ""
        return peer_auth.server_key(self.peer_token, self.server_ids[i]).hex()

    def start_server(self, i: int, wipe: bool = False) -> Proc:
        data = self.root / f"{self.server_ids[i]}"
        if wipe and data.is_mount():  # a file system of its own (storage-fault tests): empty it
            for p in data.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
        elif wipe and data.exists():
            shutil.rmtree(data)
        host, port = self.servers[i].rsplit(":", 1)
        return self._start(
            self.server_ids[i],
            "ps", "--host", host, "--port", port, "--server-id", self.server_ids[i],
            "--controllers", ",".join(self.controllers),
            "--data-dir", str(data), "--n-buckets", str(self.n_buckets), *self._flags(self.ps_opts),
            *(["--data-port", str(self.data_ports[i])] if self.data_ports[i] else []),
            *(["--rack", self.racks[i]] if self.racks else []),
            secret={"ADAMPS_PS_SERVER_KEY": self.server_key(i)} if self.peer_token else None,
        )  # fmt: skip

    def start_dataserver(self, *args: str) -> str:
        addr = f"127.0.0.1:{self.port_alloc()}"
        i = len(self.dataservers)
        self.dataservers.append(addr)
        self._start(f"dataserver{i}", "dataserver", "--port", addr.rsplit(":", 1)[1], *args)
        return addr

    def start(self, timeout: float = 60.0) -> None:
        """Starts every controller and server and waits until every bucket is fully placed.

        The servers start with the controllers, not after they answer: a server retries its
        controllers until they do, and its start (imports, LMDB) then runs while the controllers
        elect a leader, as when a deployment starts every pod at once."""
        for i in range(len(self.controllers)):
            self.start_controller(i)
        for i in range(len(self.servers)):
            self.start_server(i)
        for i, addr in enumerate(self.controllers):
            self.procs[f"controller{i}"].wait_http(f"http://{addr}/healthz", timeout)
        for i, addr in enumerate(self.servers):
            self.procs[self.server_ids[i]].wait_http(f"http://{addr}/healthz", timeout)
        self.wait_placed(timeout)

    def kill(self, name: str) -> None:
        """SIGKILL, as a machine failure would."""
        self.procs[name].kill()

    def pause(self, name: str) -> None:
        self.procs[name].signal(signal.SIGSTOP)

    def resume(self, name: str) -> None:
        self.procs[name].signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stops every process: the others at once, then the controllers at once (a parameter
        server's shutdown still talks to the controllers, as in `adamps up`)."""
        named = list(reversed(self.procs.items()))
        stop_together([p for n, p in named if not n.startswith("controller")], timeout=5)
        stop_together([p for n, p in named if n.startswith("controller")], timeout=5)
        if self.tls_files is not None:
            tls_mod.install(self._tls_before)

    def alive(self, name: str) -> bool:
        proc = self.procs.get(name)
        return proc is not None and proc.alive

    def stop_process(self, name: str, timeout: float = 5.0) -> None:
        """SIGTERM (SIGKILL after `timeout`): an orderly stop, as an operator does after a drain."""
        proc = self.procs.get(name)
        if proc is not None:
            proc.stop(timeout=timeout)

    def restart_server(self, i: int, wipe: bool = False) -> Proc:
        """SIGKILL server `i` if it runs, then start it again on its port and its data directory
        (`wipe`: an empty one, like a new machine with the same identity)."""
        name = self.server_ids[i]
        if self.alive(name):
            self.kill(name)
        return self.start_server(i, wipe=wipe)

    def add_server(self, server_id: str | None = None) -> int:
        """Starts a server with a new id (default `ps<N>`) and a new port; returns its index."""
        i = len(self.server_ids)
        self.server_ids.append(server_id or f"ps{i}")
        self.servers.append(f"127.0.0.1:{self.port_alloc()}")
        self.data_ports.append(self.port_alloc() if self.data_plane else 0)
        self.start_server(i)
        return i

    def index_of(self, server_id: str) -> int:
        return self.server_ids.index(server_id)

    def controller_post(self, path: str, body: Any = None, timeout: float = 5.0) -> tuple[int, Any]:
        """An authenticated write to the controllers: the first one that answers other than 503
        or not at all (followers forward writes to the leader)."""
        code, reply = 0, None
        for addr in self.controllers:
            code, reply = http_json(
                f"http://{addr}{path}",
                "POST",
                body if body is not None else {},
                self.token,
                timeout,
            )
            if code not in (0, 503):
                return code, reply
        return code, reply

    def drain(self, server_id: str) -> tuple[int, Any]:
        """POST /servers/{id}/drain: its buckets move away."""
        return self.controller_post(f"/servers/{server_id}/drain")

    def undrain(self, server_id: str) -> tuple[int, Any]:
        """POST /servers/{id}/undrain: it returns to service."""
        return self.controller_post(f"/servers/{server_id}/undrain")

    def rebalance(self) -> tuple[int, Any]:
        """POST /rebalance: placement recomputed over the live servers."""
        return self.controller_post("/rebalance")

    def wait_drained(self, server_id: str, timeout: float = 30.0) -> dict[str, Any]:
        return self.wait_for(
            lambda c: c["servers"].get(server_id, {}).get("state") == "drained",
            f"{server_id} drained",
            timeout,
        )

    def controller_leader(self) -> int | None:
        """Index of the controller whose /status says it is the Raft leader (None if none does)."""
        for i, addr in enumerate(self.controllers):
            if not self.alive(f"controller{i}"):
                continue
            code, st = http_json(f"http://{addr}/status", timeout=1.0)
            if code == 200 and (st.get("raft") or {}).get("role") == "leader":
                return i
        return None

    def kill_leader(self, timeout: float = 10.0) -> int | None:
        """SIGKILL the controller leader (waits up to `timeout` for one); returns its index."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            i = self.controller_leader()
            if i is not None:
                self.kill(f"controller{i}")
                return i
            time.sleep(0.1)
        return None

    def flush_server(self, i: int, timeout: float = 5.0) -> tuple[int, Any]:
        """POST /flush on server `i`: its dirty shards are written to LMDB now."""
        return http_json(f"http://{self.servers[i]}/flush", "POST", {}, self.token, timeout)

    # -- state ---------------------------------------------------------------------------------------

    def cluster(self) -> dict[str, Any] | None:
        """GET /cluster from the first controller that answers."""
        for addr in self.controllers:
            code, body = http_json(f"http://{addr}/cluster", timeout=1.0)
            if code == 200:
                return body
        return None

    def wait_for(
        self, pred: Callable[[dict[str, Any]], bool], what: str, timeout: float = 30.0
    ) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            last = self.cluster()
            if last is not None and pred(last):
                return last
            time.sleep(0.1)
        raise TimeoutError(
            f"cluster did not reach '{what}' within {timeout}s; last /cluster: {json.dumps(last)[:2000]}"
        )

    def wait_placed(self, timeout: float = 30.0) -> dict[str, Any]:
        """Until every bucket has a live primary and a full replica set, and the primaries hold
        renewed leases (their servers report themselves primary)."""

        def placed(c: dict[str, Any]) -> bool:
            want = min(int(c["replication"]), len(self.servers))
            return (
                c["unassigned"] == 0
                and c["under_replicated"] == 0
                and all(
                    len(b["secondaries"]) + 1 >= want and not b["joining"] for b in c["buckets"]
                )
            )

        c = self.wait_for(placed, "every bucket placed and replicated", timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.serves_as_primary(b["bucket"], b["address"]) for b in c["buckets"]):
                return c
            time.sleep(0.1)
            c = self.cluster() or c
        raise TimeoutError("primaries did not start serving")

    def serves_as_primary(self, bucket: int, address: str) -> bool:
        code, st = http_json(f"http://{address}/status", timeout=1.0)
        if code != 200:
            return False
        rep = (st.get("replication") or {}).get("buckets", {}).get(str(bucket))
        return bool(rep and rep["role"] == "primary" and (rep["lease_left"] or 0) > 0)

    def server_of(self, address: str) -> str:
        return self.server_ids[self.servers.index(address)]
