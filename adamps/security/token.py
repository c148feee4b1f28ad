"""The cluster token rule: no role ever runs on a well-known token (issue 12, attack 2).

The token authenticates every mutating call and is the password of the controllers' Raft port,
which unpickles what it receives: whoever knows it can run code on a controller. So:

- a role given a token uses it, unless it is a value printed in our own docs or manifests
  (``WELL_KNOWN``), which is refused like no token at all;
- a role without a token refuses to start, unless every address it listens on (and, for a
  controller, every member) is a loopback address. Then only processes of this machine can reach
  it, and it uses the *local token*: random bytes kept in a file readable by this user only
  (``$ADAMPS_LOCAL_TOKEN_FILE``, default ``~/.config/adamps/local-token``), created on first use.
  Every process of the same user on this machine shares it, so a hand-started loopback cluster
  works without configuration, and nothing about it is public: another user of the machine,
  who can reach loopback ports, cannot read the file. A warning names the file.

A random token per process would be safe but useless: the roles of one cluster must agree.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import secrets
import socket
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

#: tokens that appeared in adamps' docs, defaults or manifests: never accepted
WELL_KNOWN = frozenset(
    {
        "adamps-dev-token",
        "REPLACE-WITH-A-LONG-RANDOM-TOKEN",
        "REPLACE-WITH-ANOTHER-LONG-RANDOM-TOKEN",  # the peer token's placeholder (deploy/k8s)
    }
)


class TokenError(ValueError):
    """No usable token (the message says what to do)."""


def is_loopback(host: str) -> bool:
    """True if `host` names only loopback addresses (an IP literal or a name resolving to them)."""
    host = host.strip().strip("[]")
    if not host:
        return False
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if host == "localhost":
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(i[4][0]).is_loopback for i in infos)


def host_of(address: str) -> str:
    """The host of 'http://host:port', 'host:port' or 'host'."""
    rest = address.split("://", 1)[-1].split("/", 1)[0]
    if rest.startswith("["):
        return rest[1:].split("]", 1)[0]
    return rest.rsplit(":", 1)[0] if rest.count(":") == 1 else rest


def local_token_file() -> Path:
    env = os.environ.get("ADAMPS_LOCAL_TOKEN_FILE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "adamps" / "local-token"


def local_token(path: Path | None = None) -> str:
    """The per-user local token, created (mode 0600, race-free) if the file does not exist."""
    path = path or local_token_file()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_hex(32) + "\n")
    st = os.stat(path)
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise TokenError(
            f"local token file {path} must belong to this user and have mode 0600; "
            "fix it, or set ADAMPS_TOKEN"
        )
    token = path.read_text().strip()
    if len(token) < 32:
        raise TokenError(f"local token file {path} holds no token; delete it or set ADAMPS_TOKEN")
    return token


def resolve(token: str, listen_hosts: Iterable[str], role: str) -> str:
    """The token `role` must use: `token`, else the local token when loopback-only, else refuses.
    The refusal's message does not name `role`: the command or role that prints it does (it
    read "adamps drain: adamps drain: no cluster token ...")."""
    if token:
        if token.strip() in WELL_KNOWN:
            raise TokenError(
                "the token is a well-known value from adamps' docs; make a random one: "
                "python3 -c 'import secrets; print(secrets.token_hex(32))'"
            )
        return token
    hosts = [h for h in listen_hosts]
    public = [h for h in hosts if not is_loopback(h)]
    if public or not hosts:
        raise TokenError(
            "no cluster token (set ADAMPS_TOKEN or --token) while listening on or "
            f"reaching the non-loopback address(es) {public}; a role runs without one only on "
            "loopback"
        )
    path = local_token_file()
    tok = local_token(path)
    log.warning(
        "%s: no cluster token given; loopback only, so using this user's local token in %s "
        "(set ADAMPS_TOKEN for a cluster beyond this machine)",
        role,
        path,
    )
    return tok
