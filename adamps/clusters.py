"""Clusters found by name: the cluster file `adamps up --detach` writes, and the one rule by which
every command and ``adamps.torch`` find the controllers and the token when none is given.

The file is ``$XDG_CONFIG_HOME/adamps/clusters/NAME.json`` (default ``~/.config/...``, mode 0600):
the cluster's controllers, servers and data servers, its run directory, the path of its token
file (the token itself stays in that file) and the PIDs `adamps down` stops.

Addresses: ``--controllers``, else ``$ADAMPS_CONTROLLERS``, else the cluster named by
``--cluster`` or ``$ADAMPS_CLUSTER``, else the cluster "local" if its file exists, else
127.0.0.1:7000. Token: ``--token``, else ``$ADAMPS_TOKEN``, else the file ``$ADAMPS_TOKEN_FILE``,
else the token file of the cluster whose controllers these are, else (loopback only) this
user's local token (adamps.security.token).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from adamps.security import token as tokens

#: the cluster used when none is named (`adamps up --detach` without --name)
DEFAULT_NAME = "local"
#: the controllers when no flag, variable or cluster file gives them
FALLBACK_CONTROLLERS = "127.0.0.1:7000"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class ClusterError(ValueError):
    """No such cluster, a bad name or an unreadable cluster file (the message says which)."""


def check_name(name: str) -> str:
    if not _NAME.fullmatch(name or ""):
        raise ClusterError(
            f"cluster name {name!r}: expected 1-64 letters, digits, '_', '.' or '-' "
            "(not starting with '.', '_' or '-')"
        )
    return name


def clusters_dir() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "adamps" / "clusters"


def cluster_file(name: str) -> Path:
    return clusters_dir() / f"{check_name(name)}.json"


def write(name: str, info: dict[str, Any]) -> Path:
    """Writes NAME's cluster file (mode 0600, replaced atomically)."""
    path = cluster_file(name)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump({"name": name, **info}, fh, indent=1)
        fh.write("\n")
    os.replace(tmp, path)
    return path


def load(name: str) -> dict[str, Any]:
    path = cluster_file(name)
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise ClusterError(
            f"no cluster {name!r}: {path} does not exist (start one with "
            f"`adamps up --detach{'' if name == DEFAULT_NAME else ' --name ' + name}`)"
        ) from None
    except (OSError, ValueError) as exc:
        raise ClusterError(f"cluster file {path}: {exc}") from None
    if not isinstance(info, dict) or not isinstance(info.get("controllers"), list):
        raise ClusterError(f"cluster file {path}: no controllers in it")
    return info


def known() -> list[dict[str, Any]]:
    """Every readable cluster file."""
    out = []
    for path in sorted(clusters_dir().glob("*.json")):
        try:
            out.append(load(path.stem))
        except ClusterError:
            continue
    return out


def check_address(addr: str, what: str = "controller address") -> str:
    """`addr` when it is HOST:PORT or http(s)://HOST:PORT, else ClusterError naming it: a
    port that is not a number or out of range stopped every command with a traceback, and a
    missing one ('localhost') sent the requests to port 80."""
    url = addr if "://" in addr else f"http://{addr}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
    if (
        parts.scheme not in ("http", "https")
        or not parts.hostname
        or port is None
        or not 1 <= port <= 65535
        or parts.path.strip("/")
    ):
        raise ClusterError(
            f"{what} {addr!r}: expected HOST:PORT or http(s)://HOST:PORT with a port in "
            "1..65535, e.g. 127.0.0.1:7000"
        )
    return addr


def _split(addrs: str) -> list[str]:
    return [check_address(a.strip()) for a in addrs.split(",") if a.strip()]


def seconds(text: str) -> float:
    """An argparse type for --timeout, --wait, --stop-timeout: a finite number of seconds > 0.
    A negative or NaN timeout reached the socket as a traceback (``Timeout value out of
    range``), and 0 made every request fail as "no controller answered"."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


def _bare(addr: str) -> str:
    return addr.split("://", 1)[-1].rstrip("/")


@dataclass
class Target:
    """Where a command goes: the controllers, the token and where each came from."""

    controllers: list[str]
    token: str
    #: where the token came from, for an authorization error ("--token", "the file X", ...)
    token_from: str
    #: the cluster file's contents when the addresses or the token came from one
    cluster: dict[str, Any] | None = None

    def auth_hint(self) -> str:
        """The sentence an 'unauthorized' error gets: which token was used, where the right
        one is (the cluster files that list these controllers)."""
        mine = {_bare(a) for a in self.controllers}
        where = [
            f"the token of cluster {c['name']!r} is in {c.get('token_file')}"
            for c in known()
            if mine & {_bare(a) for a in c["controllers"]}
        ]
        hint = f"the token used came from {self.token_from}"
        return hint + ("; " + "; ".join(where) if where else "")


def _read_token_file(path: str, what: str) -> str:
    try:
        tok = Path(path).read_text().strip()
    except OSError as exc:
        raise ClusterError(f"{what} {path}: {exc.strerror or exc}") from None
    if not tok:
        raise ClusterError(f"{what} {path} holds no token")
    return tok


def find(controllers: str | None = None, cluster: str | None = None) -> tuple[list[str], Any]:
    """(controller addresses, the cluster file's contents or None): the address rule of this
    module's docstring; the cluster file is also that of given addresses when it lists them."""
    named = cluster or os.environ.get("ADAMPS_CLUSTER") or ""
    if named:
        check_name(named)
    info: dict[str, Any] | None = None
    addrs = _split(controllers or "") or _split(os.environ.get("ADAMPS_CONTROLLERS", ""))
    if not addrs:
        if named:
            info = load(named)
        elif cluster_file(DEFAULT_NAME).exists():
            info = load(DEFAULT_NAME)
        addrs = list(info["controllers"]) if info else _split(FALLBACK_CONTROLLERS)
    elif named:
        info = load(named)
    else:  # addresses given: the token of a cluster file listing them
        mine = {_bare(a) for a in addrs}
        info = next((c for c in known() if mine & {_bare(a) for a in c["controllers"]}), None)
    return addrs, info


def resolve(
    controllers: str | None = None,
    token: str | None = None,
    cluster: str | None = None,
    who: str = "adamps",
) -> Target:
    """The controllers and token a client uses (the rule in this module's docstring). Raises
    ClusterError or adamps.security.token.TokenError with a message naming what is missing."""
    addrs, info = find(controllers, cluster)
    if token:
        return Target(addrs, token, "--token", info)
    if os.environ.get("ADAMPS_TOKEN"):
        return Target(addrs, os.environ["ADAMPS_TOKEN"], "$ADAMPS_TOKEN", info)
    if os.environ.get("ADAMPS_TOKEN_FILE"):
        path = os.environ["ADAMPS_TOKEN_FILE"]
        tok = _read_token_file(path, "$ADAMPS_TOKEN_FILE")
        return Target(addrs, tok, f"the file {path} ($ADAMPS_TOKEN_FILE)", info)
    if info and info.get("token_file"):
        path = str(info["token_file"])
        tok = _read_token_file(path, f"cluster {info['name']!r}'s token file")
        return Target(addrs, tok, f"cluster {info['name']!r}'s token file {path}", info)
    tok = tokens.resolve("", map(tokens.host_of, addrs), who)
    return Target(addrs, tok, f"this user's local token file {tokens.local_token_file()}", info)


def explain(exc: BaseException, target: Target | None) -> str:
    """`exc`'s message, with the token hint when it is an authorization error."""
    msg = str(exc)
    if target is not None and getattr(exc, "code", None) in ("unauthorized", "forbidden"):
        msg += f" ({target.auth_hint()})"
    return msg


def add_arguments(parser: Any, token: bool = True) -> None:
    """--controllers, --cluster (and --token) with this module's defaults, for a command."""
    parser.add_argument(
        "--controllers",
        default=None,
        help="comma-separated HTTP addresses (host:port) of controllers (default: "
        "$ADAMPS_CONTROLLERS, else those of --cluster's file, else 127.0.0.1:7000)",
    )
    parser.add_argument(
        "--cluster",
        default=None,
        help="a cluster started by `adamps up --detach --name NAME`: its controllers and token "
        f"(default: $ADAMPS_CLUSTER, else {DEFAULT_NAME!r} when its file exists)",
    )
    if token:
        parser.add_argument(
            "--token",
            default=None,
            help="cluster token (default: $ADAMPS_TOKEN, $ADAMPS_TOKEN_FILE, the cluster's "
            "token file, else on loopback this user's local token)",
        )
