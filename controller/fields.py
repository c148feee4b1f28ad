"""The checked fields of the controller's HTTP API: path parameters and JSON body fields, each
refused with a 400 naming the bad value and what is expected."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from adamps.wire.protocol import ProtocolError, only_fields

#: the JSON body fields of each call a server makes (and of the operator's declare-lost),
#: by the route's last segment (docs/protocol-controller.md, "Parameter servers"): anything
#: else is refused by `call_fields`
SERVER_CALL_FIELDS: dict[str, tuple[str, ...]] = {
    "register": ("address", "copies", "rack", "n_buckets"),
    "heartbeat": ("known_version", "deltas", "reports", "not_durable"),
    "peer-keys": ("peers", "time", "proof"),
    "role-change": ("server", "prev_epoch", "reports"),
    "caught-up": ("primary", "epoch", "server", "join"),
    "release": ("server", "epoch"),
    "drop-secondary": ("primary", "epoch", "server"),
    "declare-lost": (),
}


def call_fields(body: dict[str, Any], call: str, path: str) -> None:
    """Refuses a server call's body naming a field `call` does not take (400 bad_request
    naming it, nothing proposed): a misspelled field of a heartbeat (`not_durabel`) or a
    role change (`prev_epcoh`) was ignored, and the call did something else than asked."""
    only_fields(body, f"POST {path}", SERVER_CALL_FIELDS[call], call=call)


def _natural(v: Any) -> bool:
    return type(v) is int and 0 <= v < 1 << 63


def epoch_seq(raw: Any, where: str) -> list[int]:
    """[epoch, seq] of a copy from JSON: a list whose first two items are integers >= 0 (a
    string "12" was taken as [1, 2], a float cut to an integer)."""
    if not isinstance(raw, list) or len(raw) < 2 or not _natural(raw[0]) or not _natural(raw[1]):
        raise ProtocolError(
            "bad_request", f"{where} must be [epoch, seq] (integers >= 0), got {str(raw)[:100]}"
        )
    return [raw[0], raw[1]]


def positions(raw: Any, n_buckets: int, name: str) -> dict[int, list[Any]]:
    """A map bucket -> [epoch, seq] from JSON (keys are strings there), checked. An offer may
    carry [epoch, seq, committed, digest] (issue 29: the digest of the copy's values at its
    committed seq, compared between tied candidates); those two are checked and kept."""
    if not isinstance(raw, dict):
        raise ProtocolError("bad_request", f"{name} must be a map bucket -> [epoch, seq]")
    out = {}
    for b, r in raw.items():
        key = b if isinstance(b, str) else str(b)
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise ProtocolError("bad_request", f"{name}: {key[:40]!r} is not a bucket id")
        bi = int(key)
        epoch, seq = epoch_seq(r, f"{name}[{key!r}]")
        if not 0 <= bi < n_buckets or len(r) not in (2, 4):
            raise ProtocolError(
                "bad_request",
                f"{name}[{key!r}]: bucket in [0, {n_buckets}), [epoch, seq] or "
                "[epoch, seq, committed, digest]",
            )
        out[bi] = [epoch, seq]
        if len(r) == 4:
            committed, dig = r[2], r[3]
            if (
                isinstance(committed, bool)
                or not isinstance(committed, int)
                or not 0 <= committed <= seq
                or not isinstance(dig, str)
                or not 0 < len(dig) <= 32
                or any(c not in "0123456789abcdef" for c in dig)
            ):
                raise ProtocolError(
                    "bad_request",
                    f"{name}[{key!r}]: [epoch, seq, committed, digest] needs 0 <= committed <= seq "
                    "and a digest of 1-32 lowercase hex digits",
                )
            out[bi] += [committed, dig]
    return out


def server_id(request: web.Request) -> str:
    sid = request.match_info["id"]
    if (
        not sid
        or len(sid) > 128
        or not all(c.isascii() and (c.isalnum() or c in "-_.") for c in sid)
    ):
        raise ProtocolError("bad_request", "server id must be 1-128 characters of [A-Za-z0-9._-]")
    return sid


def bucket(request: web.Request, n: int) -> int:
    try:
        b = int(request.match_info["bucket"])
    except ValueError:
        raise ProtocolError("bad_request", "bucket must be an integer") from None
    if not 0 <= b < n:
        raise ProtocolError("unknown_bucket", f"no bucket {b} (the cluster has {n})")
    return b


def str_field(body: dict[str, Any], name: str) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not v or len(v) > 256:
        # names the bound: a 300-character name is a string, and "non-empty" misled
        raise ProtocolError("bad_request", f"field {name!r} must be a string of 1-256 characters")
    return v


def address(body: dict[str, Any]) -> str:
    """Field address as host:port (a name or an IP literal, a port 1..65535)."""
    v = str_field(body, "address")
    host, sep, port = v.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    ok_host = (
        bool(host)
        and len(host) <= 253
        and all(c.isascii() and (c.isalnum() or c in "-._:") for c in host)
    )
    if (
        not sep
        or not ok_host
        or not (port.isascii() and port.isdigit())
        or not 1 <= int(port) <= 65535
    ):
        raise ProtocolError("bad_request", f"field 'address' must be host:port, got {v[:100]!r}")
    return v


def rack(body: dict[str, Any]) -> str | None:
    """Optional field rack (issue 26): the server's failure domain, 1-64 characters of
    [A-Za-z0-9._:-]; absent, null or empty: none (a rack of its own)."""
    v = body.get("rack")
    if v is None or v == "":
        return None
    if (
        not isinstance(v, str)
        or len(v) > 64
        or not all(c.isascii() and (c.isalnum() or c in "-_.:") for c in v)
    ):
        raise ProtocolError(
            "bad_request",
            f"field 'rack' must be 1-64 characters of [A-Za-z0-9._:-], got {str(v)[:100]!r}",
        )
    return v


def int_field(body: dict[str, Any], name: str) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise ProtocolError("bad_request", f"field {name!r} must be an integer in 0..2^63-1")
    return v


def only(body: dict[str, Any], request: web.Request, takes: tuple[str, ...]) -> None:
    """Refuses a JSON body naming a field the endpoint does not take (400 bad_request naming
    it and listing `takes`): ignored, a misspelled field silently did nothing."""
    only_fields(body, f"{request.method} {request.path}", takes)
