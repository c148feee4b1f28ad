"""docker-compose.yml, deploy/prometheus/prometheus.yml and deploy/Dockerfile, checked offline.

The Compose file is validated by a real Compose implementation (Debian's docker-compose package:
`docker-compose config` validates against the Compose schema and interpolates variables without a
Docker engine). Each service's command is parsed by the role's own argument parser, so a renamed
flag breaks this test, not a deployment.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from adamps.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
PROM_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TOKEN = "compose-test-token-0123456789"
#: adamps subcommand -> Prometheus job
JOB_OF = {"controller": "controller", "ps": "ps", "dataserver": "dataserver", "train": "trainer"}


def compose(tmp_path: Path, *args: str, token: str | None = TOKEN, file: Path = COMPOSE_FILE):
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("needs the Debian package 'docker-compose' (apt-get install docker-compose)")
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


def parse_role_argv(argv: list[str]) -> bool:
    """Parses `adamps ARGV` with the role's own parser; False if the role is not written yet."""
    module_name = COMMANDS[argv[0]][0]
    if importlib.util.find_spec(module_name) is None:
        return False
    parser = importlib.import_module(module_name).build_parser()
    try:
        parser.parse_args(argv[1:])
    except SystemExit as exc:
        raise AssertionError(f"`adamps {' '.join(argv)}` is rejected by its parser") from exc
    return True


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


def test_every_command_parses_with_its_roles_flags(resolved: dict[str, Any]) -> None:
    services = adamps_services(resolved)
    parsed = [name for name, argv in services.items() if parse_role_argv(argv)]
    missing = sorted({argv[0] for name, argv in services.items() if name not in parsed})
    if missing:
        pytest.skip(f"parsed {len(parsed)} commands; roles not written yet: {missing}")


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
    assert "pip install ." in text
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
