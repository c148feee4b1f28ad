"""The Kubernetes manifests in deploy/k8s/, validated against the Kubernetes schemas, offline.

kubernetes-validate ships the OpenAPI-derived JSON schemas of each Kubernetes release inside the
package; the test forbids network connections while it validates. Beyond the schemas: the shape
the issue asks for (StatefulSets with volumes for controllers and parameter servers, stable Raft
names, a Deployment for data servers, an Indexed Job for the trainer replicas, a Secret for the
token) and every container's command line parsed by the role's own argument parser.
"""

from __future__ import annotations

import importlib
import re
import shutil
import socket
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from adamps import config as aconfig
from adamps.cli import COMMANDS
from adamps.security.token import WELL_KNOWN

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: the oldest release the manifests need (the pod-index label) and the newest the package ships
VERSIONS = ("1.28.0", "1.37.0")
SECRET = "adamps-cluster-token"


def documents() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for _f, d in documents() if d["kind"] == kind}


def adamps_containers() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, container) for every container running the adamps image."""
    out = []
    for kind in ("StatefulSet", "Deployment", "Job"):
        for w in by_kind(kind).values():
            for c in w["spec"]["template"]["spec"]["containers"]:
                if c["image"].split(":")[0].endswith("adamps"):
                    out.append((w, c))
    return out


def flag(args: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in args if a.startswith(name + "=")]
    return value


#: adamps subcommand -> (config dataclass "module:Class", TOML section)
CONFIGS = {
    "controller": ("controller.config:ControllerConfig", "controller"),
    "ps": ("adamps.server.config:PsConfig", "ps"),
    "dataserver": ("dataserver.config:DataServerConfig", "dataserver"),
    "train": ("trainer.config:TrainConfig", "train"),
    "coordinator": ("coordinator.config:CoordinatorConfig", "coordinator"),
}


def load_role_config(argv: list[str]) -> Any:
    """`adamps ARGV` parsed by the role's own parser and loaded into its config (checks values)."""
    parser = importlib.import_module(COMMANDS[argv[0]][0]).build_parser()
    try:
        args = parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"`adamps {' '.join(argv)}` is rejected by its parser") from exc
    module, cls = CONFIGS[argv[0]][0].split(":")
    try:
        # The token reaches the process from its environment (the Secret); without one a role
        # listening beyond loopback refuses to start.
        return aconfig.load(
            getattr(importlib.import_module(module), cls),
            CONFIGS[argv[0]][1],
            args,
            environ={"ADAMPS_TOKEN": "token-from-the-environment"},
        )
    except aconfig.ConfigError as exc:
        raise AssertionError(f"`adamps {' '.join(argv)}`: {exc}") from exc


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_a: Any, **_k: Any) -> None:
        raise AssertionError("kubernetes-validate tried to use the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize("version", VERSIONS)
def test_manifests_validate_against_the_kubernetes_schemas(version: str, offline: None) -> None:
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert (schemas / f"v{version}-local-strict").is_dir(), f"kubernetes-validate lacks {version}"
    docs = documents()
    assert len(docs) >= 12
    for name, doc in docs:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(
                f"{name}: {doc['kind']}/{doc['metadata']['name']}: {exc.message} at {list(exc.path)}"
            )


def test_the_validator_rejects_a_broken_manifest(offline: None) -> None:
    sts = dict(by_kind("StatefulSet")["adamps-ps"])
    sts["spec"] = {**sts["spec"], "replicas": "three"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSIONS[-1], strict=True)
    sts["spec"] = {**by_kind("StatefulSet")["adamps-ps"]["spec"], "replica": 3}  # a typo
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, VERSIONS[-1], strict=True)


def test_stateful_roles_have_stable_names_and_volumes() -> None:
    services = by_kind("Service")
    for name, role in (("adamps-controller", "controller"), ("adamps-ps", "ps")):
        sts = by_kind("StatefulSet")[name]
        svc = services[sts["spec"]["serviceName"]]
        assert svc["spec"]["clusterIP"] == "None", (
            "stable per-pod DNS names need a headless Service"
        )
        assert svc["spec"].get("publishNotReadyAddresses") is True
        assert (
            svc["spec"]["selector"].items() <= sts["spec"]["template"]["metadata"]["labels"].items()
        )
        (claim,) = sts["spec"]["volumeClaimTemplates"]
        (c,) = sts["spec"]["template"]["spec"]["containers"]
        assert c["args"][0] == role
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert mounts[claim["metadata"]["name"]] == flag(c["args"], "--data-dir")
    # Raft members: one per controller pod, by its stable name, the HTTP port the container opens.
    sts = by_kind("StatefulSet")["adamps-controller"]
    (c,) = sts["spec"]["template"]["spec"]["containers"]
    members = flag(c["args"], "--members").split(",")
    assert len(members) == sts["spec"]["replicas"]
    svc = sts["spec"]["serviceName"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for i, m in enumerate(members):
        host, raft_port, http_port = m.rsplit(":", 2)
        assert host == f"adamps-controller-{i}.{svc}"
        assert (int(raft_port), int(http_port)) == (ports["raft"], ports["http"])
    assert flag(c["args"], "--member") == "$(POD_INDEX)"
    env = {e["name"]: e for e in c["env"]}
    assert "apps.kubernetes.io/pod-index" in env["POD_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]


def test_data_servers_are_a_deployment_and_trainers_an_indexed_job() -> None:
    services = by_kind("Service")
    d = by_kind("Deployment")["adamps-dataserver"]
    (c,) = d["spec"]["template"]["spec"]["containers"]
    assert c["args"][0] == "dataserver"
    labels = d["spec"]["template"]["metadata"]["labels"]
    assert services["adamps-dataserver"]["spec"]["selector"].items() <= labels.items()
    # Trainers: a finite run where pod k is replica k of n (an Indexed Job, not a Deployment,
    # which could not number its pods and would restart a replica that finished).
    job = by_kind("Job")["adamps-trainer"]["spec"]
    assert job["completionMode"] == "Indexed"
    (c,) = job["template"]["spec"]["containers"]
    assert c["args"][0] == "train"
    assert int(flag(c["args"], "--n-replicas")) == job["completions"] == job["parallelism"]
    assert flag(c["args"], "--replica") == "$(REPLICA_INDEX)"
    env = {e["name"]: e for e in c["env"]}
    assert "job-completion-index" in env["REPLICA_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert job["template"]["spec"]["restartPolicy"] == "OnFailure"
    labels = job["template"]["metadata"]["labels"]
    assert services["adamps-trainer"]["spec"]["selector"].items() <= labels.items()
    # Every role finds the controllers by their stable names.
    members = flag(
        by_kind("StatefulSet")["adamps-controller"]["spec"]["template"]["spec"]["containers"][0][
            "args"
        ],
        "--members",
    )
    http = {f"{h}:{hp}" for h, _rp, hp in (m.rsplit(":", 2) for m in members.split(","))}
    assert set(flag(c["args"], "--controllers").split(",")) == http
    (ps,) = by_kind("StatefulSet")["adamps-ps"]["spec"]["template"]["spec"]["containers"]
    assert set(flag(ps["args"], "--controllers").split(",")) == http
    # A parameter server is known by its pod name and reached at its stable DNS name.
    assert flag(ps["args"], "--server-id") == "$(POD_NAME)"
    assert flag(ps["args"], "--advertise") == f"$(POD_NAME).adamps-ps:{flag(ps['args'], '--port')}"


def test_the_token_comes_from_the_secret() -> None:
    (secret,) = [d for _f, d in documents() if d["kind"] == "Secret"]
    assert secret["metadata"]["name"] == SECRET and "token" in secret["stringData"]
    containers = adamps_containers()
    assert len(containers) >= 4
    for w, c in containers:
        env = {e["name"]: e for e in c["env"]}
        ref = env["ADAMPS_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (SECRET, "token"), w["metadata"]["name"]
        assert not any("token" in a.lower() for a in c["args"])


def test_the_peer_token_reaches_controllers_and_servers_only() -> None:
    """Issue 28: the peer token (replication between servers, the Raft password) is not given
    to trainers or data servers, and its placeholder is refused."""
    (secret,) = [d for _f, d in documents() if d["kind"] == "Secret"]
    assert "peer-token" in secret["stringData"]
    assert secret["stringData"]["peer-token"] in WELL_KNOWN
    given = set()
    for _w, c in adamps_containers():
        env = {e["name"]: e for e in c["env"]}
        if "ADAMPS_PEER_TOKEN" in env:
            ref = env["ADAMPS_PEER_TOKEN"]["valueFrom"]["secretKeyRef"]
            assert (ref["name"], ref["key"]) == (SECRET, "peer-token")
            given.add(c["args"][0])
    assert given == {"controller", "ps"}


def test_every_container_command_parses_with_its_roles_flags_and_config() -> None:
    loaded = 0
    for w, c in adamps_containers():
        args = [
            re.sub(r"\$\((POD_INDEX|REPLICA_INDEX)\)", "0", a).replace("$(POD_NAME)", "pod-0")
            for a in c["args"]
        ]
        cfg = load_role_config(args)
        if args[0] != "controller":
            assert cfg.host == "0.0.0.0", (
                f"{w['metadata']['name']} must listen on the pod's address"
            )
        loaded += 1
    assert loaded == 6  # 4 roles, and Sandblaster's coordinator and trainers


def test_in_cluster_prometheus_config_matches_the_compose_one(tmp_path: Path) -> None:
    cm = by_kind("ConfigMap")["adamps-prometheus"]
    cfg = yaml.safe_load(cm["data"]["prometheus.yml"])
    compose_cfg = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"] for j in cfg["scrape_configs"]}
    assert jobs == {j["job_name"] for j in compose_cfg["scrape_configs"]}
    services = by_kind("Service")
    for job in cfg["scrape_configs"]:
        for sd in job.get("dns_sd_configs", []):
            for name in sd["names"]:
                port, _proto, svc, ns = re.match(
                    r"_(\w+)\._(tcp)\.([\w-]+)\.([\w-]+)\.svc", name
                ).groups()
                assert ns == "adamps" and services[svc]["spec"]["clusterIP"] == "None", name
                assert port in {p["name"] for p in services[svc]["spec"]["ports"]}, name
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs the Debian package 'prometheus' (it ships promtool)")
    path = tmp_path / "prometheus.yml"
    path.write_text(cm["data"]["prometheus.yml"])
    out = subprocess.run(
        [promtool, "check", "config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_sandblaster_trainers_reach_the_coordinator_service() -> None:
    services = by_kind("Service")
    deploy = by_kind("Deployment")["adamps-coordinator"]
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    (coord,) = deploy["spec"]["template"]["spec"]["containers"]
    port = flag(coord["args"], "--port")
    svc = services["adamps-coordinator"]
    assert (
        svc["spec"]["selector"].items() <= deploy["spec"]["template"]["metadata"]["labels"].items()
    )
    assert str(svc["spec"]["ports"][0]["port"]) == port
    job = by_kind("Job")["adamps-sandblaster-trainer"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert flag(c["args"], "--coordinator") == f"http://adamps-coordinator:{port}"
