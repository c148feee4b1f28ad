"""TLS on a real parameter server's ports, with certificates this test generates (issue 28).

Reference: docs/operations.md, "Security" (TLS). A server started with ``$ADAMPS_TLS_*`` serves
HTTPS and TLS on its data port; a client that trusts the cluster's CA reaches both; a client
without that CA, or trusting another one, is refused before it sends a byte of its request;
with mutual TLS a client without a certificate of the CA is refused too. Every refusal leaves
the server's state as it was and the server serving.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest

from adamps.client.dataplane import DataPlaneClient
from adamps.client.rpc import SyncRpc
from adamps.security import tls, tls_certs
from adamps.up.procs import Proc, adamps_argv, free_port

pytestmark = pytest.mark.slow

TOKEN = "tls-token"
N = 1000
#: the servers' header_timeout: also the deadline of a TLS handshake
HEADER_TIMEOUT = 2.0


@contextmanager
def installed(cfg: tls.TlsConfig) -> Iterator[None]:
    """This test process speaks TLS as `cfg` says, then as before."""
    before = tls.current()
    tls.install(cfg)
    try:
        yield
    finally:
        tls.install(before)


def config_of(files: tls_certs.CertFiles, client_cert: bool = False) -> tls.TlsConfig:
    if client_cert:
        return tls.TlsConfig(cert=str(files.cert), key=str(files.key), ca=str(files.ca))
    return tls.TlsConfig(ca=str(files.ca))


def start_ps(root: Path, files: tls_certs.CertFiles, mutual: bool) -> tuple[Proc, int, int]:
    port, dport = free_port(), free_port()
    env = {"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1", **files.env(mutual=mutual)}
    argv = adamps_argv("ps", "--port", str(port), "--data-port", str(dport),
                       "--data-dir", str(root / "lmdb"), "--header-timeout", str(HEADER_TIMEOUT))  # fmt: skip
    proc = Proc(argv, root / "ps.log", env=env, name="ps")
    # the probe must present a certificate when the server asks for one
    with installed(config_of(files, client_cert=True)):
        proc.wait_http(f"https://127.0.0.1:{port}/healthz", timeout=30)
    return proc, port, dport


@pytest.fixture(scope="module", params=[False, True], ids=["tls", "mutual-tls"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tls")
    files = tls_certs.write_ca_and_cert(root)
    proc, port, dport = start_ps(root, files, mutual=request.param)
    try:
        with installed(config_of(files, client_cert=True)):
            with SyncRpc(f"127.0.0.1:{port}", TOKEN) as rpc:
                rpc.call("create", name="v", shape=[N], optimizer={"kind": "sgd", "lr": -1})
        yield {"root": root, "files": files, "port": port, "dport": dport, "mutual": request.param}
    finally:
        proc.stop()


def values(s: dict) -> np.ndarray:
    with installed(config_of(s["files"], client_cert=True)):
        with SyncRpc(f"127.0.0.1:{s['port']}", TOKEN) as rpc:
            return rpc.call("pull", tensors=["v"])["tensors"]["v"]


def test_a_client_with_the_ca_reaches_https_and_the_tls_data_port(server) -> None:
    before = values(server)
    cfg = config_of(server["files"], client_cert=server["mutual"])
    with installed(cfg):
        with SyncRpc(f"127.0.0.1:{server['port']}", TOKEN) as rpc:
            assert rpc.base_url.startswith("https://")
            rpc.call("push_dense", tensor="v", delta=np.ones(N, np.float32))
        with DataPlaneClient("127.0.0.1", server["dport"], TOKEN, timeout=10) as dp:
            assert isinstance(dp.sock, ssl.SSLSocket)
            dp.push_dense("v", np.full(N, 2.0, np.float32))
            pulled, _ = dp.pull("v")
    np.testing.assert_array_equal(pulled, before + 3.0)


def other_ca(root: Path) -> tls_certs.CertFiles:
    """A CA and certificate the server never heard of (an attacker's, or a wrong deployment's)."""
    return tls_certs.write_ca_and_cert(root / "other")


@pytest.mark.parametrize("client", ["no-tls", "system-cas", "other-ca"])
def test_a_client_that_cannot_verify_the_server_is_refused_and_nothing_changes(
    server, client: str
) -> None:
    before = values(server)
    other = other_ca(server["root"])
    cfg = {"no-tls": tls.TlsConfig(), "system-cas": None,
           "other-ca": config_of(other, client_cert=True)}[client]  # fmt: skip
    with installed(cfg or tls.TlsConfig()):
        url = f"127.0.0.1:{server['port']}" if client != "system-cas" else (
            f"https://127.0.0.1:{server['port']}")  # fmt: skip
        with SyncRpc(url, TOKEN, timeout=5) as rpc:
            with pytest.raises((ConnectionError, TimeoutError)):
                rpc.call("push_dense", tensor="v", delta=np.ones(N, np.float32))
        if client == "no-tls":
            # plain frames on the TLS data port: the server reads them as a bad handshake
            with DataPlaneClient("127.0.0.1", server["dport"], TOKEN, timeout=5) as dp:
                with pytest.raises((ConnectionError, TimeoutError, OSError)):
                    dp.push_dense("v", np.ones(N, np.float32))
        elif client == "other-ca":
            with pytest.raises(ssl.SSLCertVerificationError):
                DataPlaneClient("127.0.0.1", server["dport"], TOKEN, timeout=5)
    np.testing.assert_array_equal(values(server), before)


def test_with_mutual_tls_a_client_without_a_certificate_of_the_ca_is_refused(server) -> None:
    if not server["mutual"]:
        pytest.skip("a server without mutual TLS takes clients without certificates")
    before = values(server)
    other = other_ca(server["root"])
    # trusts the server, but presents no certificate, or one of another CA
    for cfg in (config_of(server["files"]),
                tls.TlsConfig(cert=str(other.cert), key=str(other.key),
                              ca=str(server["files"].ca))):  # fmt: skip
        with installed(cfg):
            with SyncRpc(f"127.0.0.1:{server['port']}", TOKEN, timeout=5) as rpc:
                with pytest.raises((ConnectionError, TimeoutError)):
                    rpc.call("push_dense", tensor="v", delta=np.ones(N, np.float32))
            # TLS 1.3: the server's refusal arrives with the first read after the handshake
            with pytest.raises((ConnectionError, TimeoutError, OSError)):
                with DataPlaneClient("127.0.0.1", server["dport"], TOKEN, timeout=5) as dp:
                    dp.push_dense("v", np.ones(N, np.float32))
    np.testing.assert_array_equal(values(server), before)


@pytest.mark.parametrize("port", ["port", "dport"], ids=["http", "data-plane"])
def test_a_stalled_handshake_is_closed_and_the_server_keeps_serving(server, port: str) -> None:
    """A connection that never finishes its handshake holds nothing for long: the server closes
    it within its header_timeout, not asyncio's default 60 s, and serves others meanwhile."""
    with socket.create_connection(("127.0.0.1", server[port]), timeout=15) as stalled:
        stalled.sendall(b"\x16\x03\x01")  # the first bytes of a ClientHello, then silence
        t0 = time.monotonic()
        values(server)  # others are served meanwhile
        stalled.settimeout(4 * HEADER_TIMEOUT)
        try:
            assert stalled.recv(1) == b""
        except ConnectionResetError:
            pass
        assert time.monotonic() - t0 < 4 * HEADER_TIMEOUT
