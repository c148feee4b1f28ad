"""A real Prometheus server scrapes a real local cluster; the Grafana dashboards' queries return data.

The scrape configuration is deploy/prometheus/prometheus.yml (the Compose one) with its targets
pointed at processes on loopback and a 1 s scrape interval, so the test checks the shipped job
names and paths, not a copy. Traffic (pushes, pulls, flushes, batch streams) is generated first so
that labelled counters and histograms exist. Needs the Debian package `prometheus`.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest
import yaml

from adamps.cli import COMMANDS
from adamps.procs import Proc, adamps_argv, free_port
from adamps.rpc import RpcError, SyncRpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(170)]

ROOT = Path(__file__).resolve().parents[2]
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
TOKEN = "prometheus-test-token"
METRIC_RE = re.compile(r"\badamps_[A-Za-z0-9_:]+")
#: file defining a metric -> the feature the cluster must run for it to have data
FEATURE_OF_FILE = {"adamps/server/replicate.py": "replication"}
#: metric-name prefix -> the scrape job (role) that exposes it
PREFIX_JOB = {
    "adamps_ps_": "ps",
    "adamps_controller_": "controller",
    "adamps_dataserver_": "dataserver",
    "adamps_trainer_": "trainer",
}


def metric_names() -> ModuleType:
    """deploy/grafana/metric_names.py (where each metric is defined)."""
    path = ROOT / "deploy" / "grafana" / "metric_names.py"
    spec = importlib.util.spec_from_file_location("deploy_grafana_metric_names", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def base_name(scraped: str) -> str:
    """The scraped name of a metric's series -> the name in metric_table (counters keep _total)."""
    for suffix in ("_bucket", "_sum", "_count", "_created"):
        if scraped.endswith(suffix):
            return scraped.removesuffix(suffix)
    return scraped


def role_available(command: str) -> bool:
    """Whether the module of `adamps COMMAND` exists yet (the roles are written in parallel)."""
    try:
        return importlib.util.find_spec(COMMANDS[command][0]) is not None
    except ModuleNotFoundError:
        return False


def get_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Cluster:
    """The processes of this module's cluster, by scrape job, and the traffic generators."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []
        self.targets: dict[str, list[str]] = {}  #: job -> host:port of each process
        self.not_started: dict[str, str] = {}  #: job -> why it is not running
        self.features: dict[str, str | None] = {}  #: feature -> None if running, else why not
        self.traffic: list[Callable[[], None]] = []
        self.closers: list[Callable[[], None]] = []  #: clients to close at teardown

    def start(self, job: str, name: str, *args: str, port: int) -> Proc:
        env = {"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"}
        proc = Proc(adamps_argv(*args), self.root / "logs" / f"{name}.log", env=env, name=name)
        self.procs.append(proc)
        self.targets.setdefault(job, []).append(f"127.0.0.1:{port}")
        return proc

    def stop(self) -> None:
        for close in self.closers:
            close()
        for p in reversed(self.procs):
            p.stop(timeout=5)


def start_ps(c: Cluster) -> None:
    import dataclasses

    from adamps.server.config import PsConfig

    if "controllers" not in {f.name for f in dataclasses.fields(PsConfig)}:
        c.features["replication"] = (
            "the PS has no --controllers yet: it runs on its static bucket map"
        )
    port = free_port()
    proc = c.start("ps", "ps-1", "ps", "--port", str(port), "--data-dir", str(c.root / "ps-1"),
                   "--flush-interval", "0.5", port=port)  # fmt: skip
    proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
    rpc = SyncRpc(f"http://127.0.0.1:{port}", TOKEN)
    c.closers.append(rpc.close)
    rpc.call("create", name="w", shape=[64, 32], init={"kind": "xavier", "seed": 1},
             optimizer={"kind": "adagrad", "lr": 0.1})  # fmt: skip
    g = np.random.default_rng(0)

    def traffic() -> None:
        rpc.call("push_dense", tensor="w", delta=g.standard_normal((64, 32)).astype(np.float32))
        rpc.call("push_fc", tensor="w", a=g.standard_normal((4, 32)).astype(np.float32),
                 e=g.standard_normal((4, 64)).astype(np.float32))  # fmt: skip
        rpc.call("pull", tensors=["w"])

    c.traffic.append(traffic)


def start_dataserver(c: Cluster) -> None:
    from dataserver.client import DataClient

    port = free_port()
    proc = c.start("dataserver", "dataserver", "dataserver", "--port", str(port), "--source",
                   "builtin", "--workers", "0", "--ahead", "1", port=port)  # fmt: skip
    proc.wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
    client = DataClient([f"http://127.0.0.1:{port}"], TOKEN)
    epoch = iter(range(10_000))

    def traffic() -> None:
        with client.epoch(0, 8, next(epoch), batch_size=100) as batches:
            for _ in zip(range(2), batches, strict=False):
                pass

    c.traffic.append(traffic)


def start_controllers(c: Cluster) -> None:
    http = [free_port() for _ in range(3)]
    members = ",".join(f"127.0.0.1:{free_port()}:{h}" for h in http)
    started = [
        c.start("controller", f"controller-{i}", "controller", "--members", members, "--member",
                str(i), "--data-dir", str(c.root / f"controller-{i}"), port=h)
        for i, h in enumerate(http)
    ]  # fmt: skip
    for proc, h in zip(started, http, strict=True):
        proc.wait_http(f"http://127.0.0.1:{h}/healthz", timeout=30)
    clients = [SyncRpc(f"http://127.0.0.1:{h}", TOKEN, timeout=10) for h in http]
    c.closers.extend(cl.close for cl in clients)
    deadline = time.monotonic() + 30
    while True:  # the first write commits once a leader is elected
        try:
            clients[0].post_json("/rebalance", {})
            break
        except RpcError:
            assert time.monotonic() < deadline, "no controller leader within 30 s"
            time.sleep(0.2)

    def traffic() -> None:
        for cl in clients:  # followers forward to the leader
            cl.post_json("/rebalance", {})
            cl.get_json("/routing")

    c.traffic.append(traffic)


#: job -> (command whose module must exist, starter); extended as the roles land.
ROLES: dict[str, tuple[str, Callable[[Cluster], None]]] = {
    "controller": ("controller", start_controllers),
    "ps": ("ps", start_ps),
    "dataserver": ("dataserver", start_dataserver),
}


def scrape_config(targets: dict[str, list[str]], prom_port: int) -> dict[str, Any]:
    """deploy/prometheus/prometheus.yml with local targets and a 1 s scrape interval."""
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    cfg["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    jobs = []
    for job in cfg["scrape_configs"]:
        name = job["job_name"]
        local = [f"127.0.0.1:{prom_port}"] if name == "prometheus" else targets.get(name)
        if local:
            job["static_configs"] = [{"targets": local}]
            jobs.append(job)
    cfg["scrape_configs"] = jobs
    return cfg


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, str]]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("needs the Debian package 'prometheus' (apt-get install prometheus)")
    root = tmp_path_factory.mktemp("prom")
    cluster = Cluster(root)
    try:
        for job, (command, starter) in ROLES.items():
            if role_available(command):
                starter(cluster)
            else:
                cluster.not_started[job] = f"{COMMANDS[command][0]} is not written yet"
        for job in ("trainer",):
            if job not in ROLES:
                cluster.not_started.setdefault(job, "the test does not start this role yet")
        prom_port = free_port()
        cfg_path = root / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(scrape_config(cluster.targets, prom_port)))
        prom = Proc(
            [binary, f"--config.file={cfg_path}", f"--storage.tsdb.path={root / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            root / "logs" / "prometheus.log",
            name="prometheus",
        )  # fmt: skip
        cluster.procs.append(prom)
        prom.wait_http(f"http://127.0.0.1:{prom_port}/-/ready", timeout=30)
        yield cluster, f"http://127.0.0.1:{prom_port}"
    finally:
        cluster.stop()


def test_every_target_is_up(stack: tuple[Cluster, str]) -> None:
    cluster, prom = stack
    expected = {(job, t) for job, ts in cluster.targets.items() for t in ts}
    assert expected, "no role could be started"
    deadline = time.monotonic() + 30
    while True:
        active = get_json(f"{prom}/api/v1/targets?state=active")["data"]["activeTargets"]
        health = {(t["labels"]["job"], t["labels"]["instance"]): t["health"] for t in active}
        errors = {k: t.get("lastError") for t in active if (k := (t["labels"]["job"], t["labels"]["instance"])) and t["health"] != "up"}  # fmt: skip
        if expected <= set(health) and not errors:
            break
        assert time.monotonic() < deadline, f"targets not up after 30 s: {health} errors {errors}"
        time.sleep(0.5)
    assert health[("prometheus", prom.rsplit("/", 1)[1])] == "up"


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, PromQL) of every query of every dashboard."""
    out = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                out.append((path.name, panel["title"], target["expr"]))
    return out


def query(prom: str, expr: str) -> list[dict[str, Any]]:
    url = f"{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    reply = get_json(url)
    assert reply["status"] == "success", (expr, reply)
    return reply["data"]["result"]


def test_every_dashboard_query_returns_data(stack: tuple[Cluster, str]) -> None:
    cluster, prom = stack
    queries = dashboard_queries()
    assert len(queries) >= 10, "the dashboards have fewer queries than expected"
    # Which queries can be answered: those whose metrics come from roles and features running here.
    file_of = {row["name"]: row["file"] for row in metric_names().metric_table()}
    blocked: dict[str, str] = {}
    for _file, _title, expr in queries:
        for metric in METRIC_RE.findall(expr):
            job = next(j for prefix, j in PREFIX_JOB.items() if metric.startswith(prefix))
            feature = FEATURE_OF_FILE.get(file_of.get(base_name(metric), ""))
            if job in cluster.not_started:
                blocked[expr] = f"{job}: {cluster.not_started[job]}"
            elif feature and cluster.features.get(feature, "not started by this test"):
                blocked[expr] = (
                    f"{feature}: {cluster.features.get(feature, 'not started by this test')}"
                )
    todo = [q for q in queries if q[2] not in blocked]
    assert todo

    stop = threading.Event()
    errors: list[BaseException] = []

    def drive() -> None:
        # Steady traffic while Prometheus scrapes, so that rates are non-zero over >= 2 scrapes.
        while not stop.is_set():
            for gen in cluster.traffic:
                try:
                    gen()
                except BaseException as exc:  # surfaced by the assertion below
                    errors.append(exc)
                    return
            stop.wait(0.2)

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    try:
        empty = todo
        deadline = time.monotonic() + 45
        while empty and time.monotonic() < deadline and not errors:
            time.sleep(1.0)
            empty = [q for q in empty if not query(prom, q[2])]
    finally:
        stop.set()
        driver.join(30)
    assert not errors, f"traffic generation failed: {errors[0]!r}"
    assert not empty, "queries without data after 45 s:\n" + "\n".join(
        f"  {f} / {t}: {e}" for f, t, e in empty
    )
    if blocked:
        by_reason: dict[str, set[str]] = {}
        for expr, why in blocked.items():
            by_reason.setdefault(why, set()).update(METRIC_RE.findall(expr))
        pytest.skip(
            f"{len(todo)} queries return data; {len(blocked)} could not be checked yet: "
            + "; ".join(f"{why} [{', '.join(sorted(m))}]" for why, m in by_reason.items())
        )
