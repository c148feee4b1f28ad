"""TLS on every port, as an option (issue 28): one ``[tls]`` configuration for every role.

A process either speaks TLS on every connection it opens or accepts, or on none: a cluster's
processes share one CA, so one setting per process is enough, and the clients built deep inside
a role (the PS's peers, the controllers' forwarding, a trainer's data-plane pool) need no
parameter threaded through them. The setting comes, like every other, from ``--tls-*`` flags,
``$ADAMPS_TLS_*`` or the ``[tls]`` table of the TOML file; a role installs it at start
(:func:`install`), and a process that installs nothing (a user's script with a ``PSClient``)
reads ``$ADAMPS_TLS_*`` on first use, so ``ADAMPS_TLS_CA=ca.pem python train.py`` just works.

- Servers present ``cert``/``key``; clients verify the server against ``ca`` and its name (the
  certificate must name the address clients dial: a DNS name or an IP address SAN).
- With ``mutual``, servers also require a client certificate signed by ``ca``, and clients
  present ``cert``/``key``: only holders of a key the CA signed can open a connection at all.
  That is transport identity; which *server* sent a replication message is still proven by
  the peer MACs (adamps.security.peer_auth), whatever the transport.

Every socket is wrapped in one place: :func:`server_context` for listeners (aiohttp sites,
the data plane's ``create_server``), :func:`client_context` for ``http.client``, aiohttp,
``asyncio.open_connection`` and :func:`wrap_client` for blocking sockets.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from adamps import config
from adamps.config import field

SECTION = "tls"


@dataclass(frozen=True)
class TlsConfig:
    """TLS for every port of a process; all empty (the default) = plain TCP."""

    cert: str = field("", help="PEM certificate (chain) this process presents; servers need one")
    key: str = field("", help="PEM private key of the certificate")
    ca: str = field(
        "",
        help="PEM CA bundle; setting it turns TLS on: every client verifies servers against it",
    )
    mutual: bool = field(
        False,
        help="mutual TLS: servers require a client certificate signed by the CA, clients "
        "present their cert and key",
    )

    def __post_init__(self) -> None:
        if self.enabled and not self.ca:
            raise config.ConfigError(
                "tls.ca: empty while tls.cert or tls.key is set; expected the CA file clients "
                "verify servers against"
            )
        if bool(self.cert) != bool(self.key):
            raise config.ConfigError("tls.cert and tls.key: expected both or neither")
        if self.mutual and not self.cert:
            raise config.ConfigError("tls.mutual: set, but no tls.cert/tls.key to present")
        for name in ("cert", "key", "ca"):
            path = getattr(self, name)
            if path and not os.path.isfile(path):
                raise config.ConfigError(f"tls.{name}: {path!r} is not a readable file")

    @property
    def enabled(self) -> bool:
        return bool(self.ca or self.cert or self.key)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca``, ``--tls-mutual`` (dest ``tls_<field>``)."""
    group = parser.add_argument_group("TLS (every port; also $ADAMPS_TLS_* and [tls] in TOML)")
    for f in dataclasses.fields(TlsConfig):
        flag, dest = f"--tls-{f.name}", f"tls_{f.name}"
        text = f.metadata["help"].replace("%", "%%")
        if f.type in (bool, "bool"):
            group.add_argument(
                flag, dest=dest, default=None, action=argparse.BooleanOptionalAction, help=text
            )
        else:
            group.add_argument(flag, dest=dest, default=None, metavar="FILE", help=text)


def load(
    args: argparse.Namespace | Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> TlsConfig:
    """The ``[tls]`` configuration: defaults < TOML (``--config``) < $ADAMPS_TLS_* < flags."""
    given = vars(args) if isinstance(args, argparse.Namespace) else dict(args or {})
    flags = {k[4:]: v for k, v in given.items() if k.startswith("tls_")}
    return config.load(TlsConfig, SECTION, {"config": given.get("config"), **flags},
                       environ=environ)  # fmt: skip


#: the process's setting (None = not installed yet: read from the environment on first use)
_current: TlsConfig | None = None


def install(cfg: TlsConfig | None) -> None:
    """Makes `cfg` the setting of every connection this process opens or accepts from now on
    (None: read the environment again on next use)."""
    global _current
    _current = cfg


def current() -> TlsConfig:
    global _current
    if _current is None:
        _current = load()
    return _current


def enabled() -> bool:
    return current().enabled


def scheme() -> str:
    return "https" if enabled() else "http"


def url(addr: str) -> str:
    """'host:port' or a URL -> a URL without a trailing slash, https when TLS is on (an
    ``http://`` URL is upgraded: a process speaks TLS to every peer or to none)."""
    addr = addr.rstrip("/")
    if "://" not in addr:
        return f"{scheme()}://{addr}"
    if enabled() and addr.startswith("http://"):
        return "https://" + addr[len("http://") :]
    return addr


@functools.lru_cache(maxsize=8)
def _server_context(cfg: TlsConfig) -> ssl.SSLContext:
    if not cfg.cert:
        raise config.ConfigError("tls: this process serves TLS, but tls.cert/tls.key are empty")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, cfg)
    if cfg.mutual:
        ctx.load_verify_locations(cfg.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@functools.lru_cache(maxsize=8)
def _client_context(cfg: TlsConfig) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cfg.ca)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if cfg.cert:  # presented when the server asks (mutual TLS)
        _load_chain(ctx, cfg)
    return ctx


def _load_chain(ctx: ssl.SSLContext, cfg: TlsConfig) -> None:
    try:
        ctx.load_cert_chain(cfg.cert, cfg.key)
    except (OSError, ssl.SSLError) as exc:
        raise config.ConfigError(
            f"tls.cert {cfg.cert!r} / tls.key {cfg.key!r}: {exc}; expected a PEM certificate "
            "and its private key"
        ) from None


def server_context() -> ssl.SSLContext | None:
    """The context of every listener of this process, None without TLS."""
    cfg = current()
    return _server_context(cfg) if cfg.enabled else None


def client_context() -> ssl.SSLContext | None:
    """The context of every connection this process opens, None without TLS."""
    cfg = current()
    return _client_context(cfg) if cfg.enabled else None


def wrap_client(sock: socket.socket, host: str) -> socket.socket:
    """A connected blocking socket, wrapped (handshake done, server verified) when TLS is on."""
    ctx = client_context()
    if ctx is None:
        return sock
    try:
        return ctx.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def listen_kwargs(handshake_timeout: float) -> dict[str, Any]:
    """The TLS arguments of ``loop.create_server`` (none without TLS). The handshake gets the
    same deadline as a request head: before it ends the connection is not the protocol's yet,
    so nothing else bounds it (asyncio's default is 60 s)."""
    ctx = server_context()
    return {} if ctx is None else {"ssl": ctx, "ssl_handshake_timeout": handshake_timeout}


def connect_kwargs(host: str) -> dict[str, Any]:
    """The TLS arguments of ``asyncio.open_connection`` to `host` (none without TLS)."""
    ctx = client_context()
    return {} if ctx is None else {"ssl": ctx, "server_hostname": host}


def install_from(args: argparse.Namespace) -> None:
    """Installs the ``--tls-*`` flags of a command (over $ADAMPS_TLS_* and defaults); raises
    ConfigError naming a bad value."""
    install(load(args))
