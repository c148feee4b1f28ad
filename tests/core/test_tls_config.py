"""The [tls] configuration (adamps/security/tls.py): one table for every role, its checks, and how a
process's URLs follow it. No sockets: the handshakes are tests/system/test_tls.py's."""

from __future__ import annotations

import ssl
from pathlib import Path

import pytest

from adamps import config
from adamps.security import tls, tls_certs


@pytest.fixture
def files(tmp_path: Path) -> tls_certs.CertFiles:
    return tls_certs.write_ca_and_cert(tmp_path)


@pytest.fixture(autouse=True)
def restore_tls():
    before = tls.current()
    yield
    tls.install(before)


def test_nothing_set_is_plain_tcp() -> None:
    cfg = tls.load(environ={})
    assert not cfg.enabled
    tls.install(cfg)
    assert tls.url("127.0.0.1:7100") == "http://127.0.0.1:7100"
    assert tls.server_context() is None and tls.client_context() is None
    assert tls.listen_kwargs(1.0) == {} and tls.connect_kwargs("h") == {}


def test_environment_then_flags(files: tls_certs.CertFiles, tmp_path: Path) -> None:
    env = files.env()
    cfg = tls.load(environ=env)
    assert (cfg.ca, cfg.cert, cfg.key, cfg.mutual) == (str(files.ca), str(files.cert),
                                                       str(files.key), False)  # fmt: skip
    other = tls_certs.write_ca_and_cert(tmp_path / "other")
    cfg = tls.load({"tls_ca": str(other.ca), "tls_mutual": True}, environ=env)
    assert cfg.ca == str(other.ca) and cfg.cert == str(files.cert) and cfg.mutual
    toml = tmp_path / "c.toml"
    toml.write_text(f'[tls]\nca = "{files.ca}"\n')
    assert tls.load({"config": str(toml)}, environ={}).ca == str(files.ca)


def test_with_tls_urls_are_https_and_http_is_upgraded(files: tls_certs.CertFiles) -> None:
    tls.install(tls.load(environ=files.env()))
    assert tls.url("127.0.0.1:7100/") == "https://127.0.0.1:7100"
    assert tls.url("http://ds:7300") == "https://ds:7300"
    assert tls.url("https://ds:7300") == "https://ds:7300"
    server, client = tls.server_context(), tls.client_context()
    assert server is not None and server.verify_mode == ssl.CERT_NONE  # not mutual
    assert client is not None and client.check_hostname
    assert client.verify_mode == ssl.CERT_REQUIRED
    assert tls.listen_kwargs(2.0)["ssl_handshake_timeout"] == 2.0
    assert tls.connect_kwargs("h")["server_hostname"] == "h"


def test_mutual_tls_requires_client_certificates(files: tls_certs.CertFiles) -> None:
    tls.install(tls.load(environ=files.env(mutual=True)))
    server = tls.server_context()
    assert server is not None and server.verify_mode == ssl.CERT_REQUIRED


@pytest.mark.parametrize(
    "env, words",
    [
        ({"ADAMPS_TLS_CERT": "{cert}", "ADAMPS_TLS_KEY": "{key}"}, ["tls.ca", "empty"]),
        ({"ADAMPS_TLS_CA": "{ca}", "ADAMPS_TLS_CERT": "{cert}"}, ["tls.cert and tls.key"]),
        ({"ADAMPS_TLS_CA": "{ca}", "ADAMPS_TLS_MUTUAL": "1"}, ["tls.mutual"]),
        ({"ADAMPS_TLS_CA": "/no/such/ca.pem"}, ["tls.ca", "/no/such/ca.pem"]),
        ({"ADAMPS_TLS_CA": "{ca}", "ADAMPS_TLS_MUTUAL": "maybe"}, ["mutual", "'maybe'"]),
    ],
)
def test_a_bad_setting_is_refused_naming_it(files: tls_certs.CertFiles, env, words) -> None:
    env = {k: v.format(ca=files.ca, cert=files.cert, key=files.key) for k, v in env.items()}
    with pytest.raises(config.ConfigError) as err:
        tls.load(environ=env)
    for w in words:
        assert w in str(err.value)


def test_a_key_that_is_not_the_certificates_is_refused(
    files: tls_certs.CertFiles, tmp_path: Path
) -> None:
    other = tls_certs.write_ca_and_cert(tmp_path / "other")
    tls.install(tls.TlsConfig(cert=str(files.cert), key=str(other.key), ca=str(files.ca)))
    with pytest.raises(config.ConfigError) as err:
        tls.server_context()
    assert str(files.cert) in str(err.value)


def test_a_role_with_a_bad_tls_setting_exits_2_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from adamps.server.main import main as ps_main
    from controller.status import main as status_main

    assert ps_main(["--tls-ca", "/no/such/ca.pem"]) == 2
    assert "/no/such/ca.pem" in capsys.readouterr().err
    assert status_main(["--controllers", "127.0.0.1:1", "--tls-ca", "/no/such/ca.pem"]) == 2
    assert "/no/such/ca.pem" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "list", "--controllers", "127.0.0.1:1"],
        ["checkpoint", "save", "--controllers", "127.0.0.1:1", "--to", "/tmp/never"],
        ["checkpoint", "restore", "--controllers", "127.0.0.1:1", "--from", "/tmp/never"],
        ["export", "--controllers", "127.0.0.1:1", "--out", "/tmp/never.npz"],
        ["drain", "ps0", "--controllers", "127.0.0.1:1"],
    ],
    ids=["run", "checkpoint-save", "checkpoint-restore", "export", "drain"],
)
def test_every_command_that_talks_to_a_cluster_takes_the_tls_flags(argv: list[str]) -> None:
    """A cluster with TLS on is reachable from every command (a bad CA file: exit 2, named)."""
    import subprocess

    from adamps.up.procs import adamps_argv

    done = subprocess.run(
        adamps_argv(*argv, "--token", "t" * 32, "--tls-ca", "/no/such/ca.pem"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "/no/such/ca.pem" in done.stderr and "unrecognized" not in done.stderr, done.stderr
