"""A real Prometheus server scrapes a real local cluster; the Grafana dashboards' queries return data.

The cluster is every role as its own process on loopback: 3 controllers (Raft), parameter
servers replicating their buckets (a 4th joins during the test, so buckets move to it by state
transfer), a data server and a trainer replica training adam-mnist against them. The scrape configuration is deploy/prometheus/prometheus.yml (the Compose one) with
its targets pointed at these processes and a 1 s scrape interval, so the test checks the shipped
job names and paths, not a copy. Traffic (pushes, pulls, batch streams, controller writes) runs
while Prometheus scrapes, so that labelled counters and histograms exist and rates are non-zero.
Needs the Debian package `prometheus`.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from adamps.client import ControllerRouting, PSClient
from adamps.client.rpc import RpcError, SyncRpc
from adamps.layout import Layout, TensorSpec
from adamps.up.cluster import LocalCluster
from adamps.up.procs import Proc, adamps_argv, free_port
from dataserver.client import DataClient

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]

ROOT = Path(__file__).resolve().parents[2]
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
TOKEN = "prometheus-test-token"
N_BUCKETS = 16


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Stack:
    """The cluster, the trainer, Prometheus, and the traffic generators of this module."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cluster = LocalCluster(
            root / "cluster", token=TOKEN, n_servers=4, n_buckets=N_BUCKETS,
            ps_opts={"flush-interval": 0.5},
        )  # fmt: skip
        self.procs: list[Proc] = []  #: started here (trainer, Prometheus)
        self.targets: dict[str, list[str]] = {}  #: scrape job -> host:port of each process
        self.traffic: list[Callable[[], None]] = []
        self.closers: list[Callable[[], None]] = []  #: clients to close at teardown
        self.prometheus = ""  #: base URL

    def start(self) -> None:
        c = self.cluster
        # 3 controllers and 3 servers until every bucket is placed with 3 copies; the 4th server
        # joins once the model's tensors exist, so that buckets move to it by state transfer.
        for i in range(3):
            c.start_controller(i)
        for i, addr in enumerate(c.controllers):
            c.procs[f"controller{i}"].wait_http(f"http://{addr}/healthz", timeout=60)
        for i in range(3):
            c.start_server(i)
        for i in range(3):
            c.procs[c.server_ids[i]].wait_http(f"http://{c.servers[i]}/healthz", timeout=60)
        c.wait_placed(timeout=60)
        ds = c.start_dataserver("--workers", "0", "--ahead", "1")
        c.procs["dataserver0"].wait_http(f"http://{ds}/healthz", timeout=60)
        trainer_port = free_port()
        # One replica that keeps training (many epochs) while Prometheus scrapes; compressed
        # (Strom), so that the compression panels have series too, and cut into 2 partitions
        # (the model-parallelism panels; Prometheus scrapes the leader).
        trainer = Proc(
            adamps_argv(
                "train", "--controllers", ",".join(c.controllers), "--dataservers", f"http://{ds}",
                "--replica", "0", "--n-replicas", "1", "--epochs", "100", "--warm-start", "0",
                "--workers", "1", "--worker-mode", "thread", "--metrics-port", str(trainer_port),
                "--compress", "--partitions", "2",
            ),
            self.root / "logs" / "trainer.log", env=c.env, name="trainer",
        )  # fmt: skip
        self.procs.append(trainer)
        trainer.wait_http(f"http://127.0.0.1:{trainer_port}/healthz", timeout=60)
        self.targets = {
            "controller": list(c.controllers),
            "ps": list(c.servers),
            "dataserver": list(c.dataservers),
            "trainer": [f"127.0.0.1:{trainer_port}"],
        }
        self._traffic(ds)
        c.start_server(3)
        c.procs[c.server_ids[3]].wait_http(f"http://{c.servers[3]}/healthz", timeout=60)

    def _traffic(self, ds: str) -> None:
        c = self.cluster
        spec = TensorSpec("probe", (64, 32))
        ps = PSClient(ControllerRouting(c.controllers), Layout([], n_buckets=N_BUCKETS), TOKEN)
        ps.create(
            spec, init={"kind": "xavier", "seed": 1}, optimizer={"kind": "adagrad", "lr": 0.1}
        )
        ctl = [SyncRpc(f"http://{a}", TOKEN, timeout=10) for a in c.controllers]
        data = DataClient([f"http://{ds}"], TOKEN)
        self.closers += [ps.close, *(x.close for x in ctl)]
        g = np.random.default_rng(0)
        epoch = iter(range(1, 10_000))

        def push_pull() -> None:
            ps.push_dense("probe", g.standard_normal((64, 32)).astype(np.float32))
            ps.push_fc("probe", g.standard_normal((4, 32)).astype(np.float32),
                       g.standard_normal((4, 64)).astype(np.float32))  # fmt: skip
            ps.pull(["probe"])

        def controller_writes() -> None:
            for rpc in ctl:  # followers forward to the leader
                rpc.post_json("/rebalance", {})
                rpc.get_json("/routing")

        def batches() -> None:
            with data.epoch(1, 8, next(epoch), batch_size=100) as it:
                for _ in zip(range(2), it, strict=False):
                    pass

        # A run (issue 25) with quotas, whose token pushes its own tensor and is refused on the
        # cluster's: the per-run panels (elements, bytes, push rate, quota use, refusals).
        run = ctl[0].post_json(
            "/runs",
            {"name": "probe", "quotas": {"param_elems": 1 << 20, "push_bytes_per_s": 1 << 30}},
        )
        run_spec = TensorSpec("probe..t", (64, 32))
        rps = PSClient(
            ControllerRouting(c.controllers), Layout([], n_buckets=N_BUCKETS), run["token"]
        )
        intruder = SyncRpc(f"http://{c.servers[0]}", run["token"], timeout=10)
        self.closers += [rps.close, intruder.close]
        rps.create(run_spec, init={"kind": "zeros"}, optimizer={"kind": "sgd", "lr": 0.1})

        def run_pushes() -> None:
            rps.push_dense("probe..t", g.standard_normal((64, 32)).astype(np.float32))
            try:
                intruder.call("pull", "/rpc", tensors=["probe"])  # not its namespace: refused
            except RpcError as exc:
                assert exc.code == "forbidden", exc

        self.traffic += [push_pull, controller_writes, batches, run_pushes]

    def start_prometheus(self, binary: str) -> None:
        port = free_port()
        cfg = yaml.safe_load(PROM_CONFIG.read_text())
        cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
        for job in cfg["scrape_configs"]:
            name = job["job_name"]
            local = [f"127.0.0.1:{port}"] if name == "prometheus" else self.targets[name]
            job["static_configs"] = [{"targets": local}]
        path = self.root / "prometheus.yml"
        path.write_text(yaml.safe_dump(cfg))
        prom = Proc(
            [binary, f"--config.file={path}", f"--storage.tsdb.path={self.root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            self.root / "logs" / "prometheus.log", name="prometheus",
        )  # fmt: skip
        self.procs.append(prom)
        self.prometheus = f"http://127.0.0.1:{port}"
        self.targets["prometheus"] = [f"127.0.0.1:{port}"]
        prom.wait_http(f"{self.prometheus}/-/ready", timeout=30)

    def stop(self) -> None:
        for close in self.closers:
            close()
        for p in reversed(self.procs):
            p.stop(timeout=5)
        self.cluster.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs the Debian package 'prometheus' (apt-get install prometheus)")
    s = Stack(tmp_path_factory.mktemp("prom"))
    try:
        s.start()
        s.start_prometheus(binary)
        yield s
    finally:
        s.stop()


def test_every_target_is_up(stack: Stack) -> None:
    expected = {(job, t) for job, ts in stack.targets.items() for t in ts}
    assert {job for job, _t in expected} == {
        "controller",
        "ps",
        "dataserver",
        "trainer",
        "prometheus",
    }
    deadline = time.monotonic() + 30
    while True:
        active = get_json(f"{stack.prometheus}/api/v1/targets?state=active")["data"][
            "activeTargets"
        ]
        health = {
            (t["labels"]["job"], t["labels"]["instance"]): (t["health"], t["lastError"])
            for t in active
        }
        if set(health) == expected and all(h == "up" for h, _e in health.values()):
            return
        assert time.monotonic() < deadline, f"targets not all up after 30 s: {health}"
        time.sleep(0.5)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) of every query of every dashboard."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    reply = get_json(f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_every_dashboard_query_returns_data(stack: Stack) -> None:
    queries = dashboard_queries()
    assert len(queries) >= 40, "the dashboards have fewer queries than expected"
    stop = threading.Event()
    errors: list[BaseException] = []

    def drive() -> None:
        # Steady traffic while Prometheus scrapes, so that rates are non-zero over >= 2 scrapes.
        while not stop.is_set():
            for gen in stack.traffic:
                try:
                    gen()
                except BaseException as exc:  # surfaced by the assertion below
                    errors.append(exc)
                    return
            stop.wait(0.2)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        empty = queries
        deadline = time.monotonic() + 45
        while empty and time.monotonic() < deadline and not errors:
            time.sleep(1.0)
            empty = [q for q in empty if not query(stack.prometheus, q[2])]
    finally:
        stop.set()
        driver.join(30)
    assert not errors, f"traffic generation failed: {errors[0]!r}"
    assert not empty, "queries without data after 45 s:\n" + "\n".join(
        f"  {f} / {t}: {e}" for f, t, e in empty
    )
