"""Where a client sends each bucket's requests: the routing table (bucket -> primary, its
secondaries, the buckets with no live copy) and where it comes from, the controllers' table or a
static list of servers each holding its configured buckets. Moved out of ``ps`` (which re-exports
every name) to keep that module to the pulls and pushes."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from adamps.client.rpc import RpcError, base_url


@dataclass(frozen=True)
class Route:
    bucket: int
    #: base URL of the bucket's primary
    primary: str
    epoch: int = 0
    #: base URLs of the secondaries (creates go to every replica)
    secondaries: tuple[str, ...] = ()


@dataclass(frozen=True)
class Routing:
    version: int
    routes: Mapping[int, Route]
    #: every live server's base URL (a copy may be joining any bucket; creates go to all)
    all_servers: tuple[str, ...] = ()
    #: buckets with no live copy to serve them (the controllers' state "unavailable")
    unavailable: frozenset[int] = frozenset()

    def servers(self) -> list[str]:
        """Every server known: the table's server list, and every replica of every bucket."""
        seen: dict[str, None] = dict.fromkeys(self.all_servers)
        for r in self.routes.values():
            seen[r.primary] = None
            for s in r.secondaries:
                seen[s] = None
        return list(seen)


class RoutingSource(Protocol):
    def fetch(self, rpc_for: Any) -> Routing: ...


class StaticRouting:
    """Servers that each hold a fixed set of buckets (their `buckets` config): no controller."""

    def __init__(self, servers: Sequence[str], n_buckets: int) -> None:
        if not servers:
            raise ValueError("StaticRouting needs at least one server URL")
        self.servers = [normalize_url(s) for s in servers]
        self.n_buckets = n_buckets

    def fetch(self, rpc_for: Any) -> Routing:
        routes: dict[int, Route] = {}
        for url in self.servers:
            status = rpc_for(url).get_json("/status")
            held = status.get("buckets")
            buckets = range(self.n_buckets) if held in (None, "all") else held
            for b in buckets:
                routes.setdefault(int(b), Route(int(b), url))
        return Routing(0, routes)


class ControllerRouting:
    """The controllers' routing table (GET /routing on any controller; tries each in turn)."""

    def __init__(self, controllers: Sequence[str]) -> None:
        if not controllers:
            raise ValueError("ControllerRouting needs at least one controller URL")
        self.controllers = [normalize_url(c) for c in controllers]

    def fetch(self, rpc_for: Any) -> Routing:
        errors = []
        for url in self.controllers:
            try:
                table = rpc_for(url).get_json("/routing")
            except (ConnectionError, TimeoutError, RpcError) as exc:
                errors.append(f"{url}: {exc}")
                continue
            return routing_from_table(table)
        raise ConnectionError("no controller answered the routing table: " + "; ".join(errors))


def routing_from_table(table: Mapping[str, Any]) -> Routing:
    """A Routing from the controllers' JSON table (docs/protocol-controller.md, GET /routing)."""
    addresses = table.get("servers", {})
    routes = {}
    unavailable = set()
    for entry in table.get("buckets", []):
        primary = entry.get("address")
        b = int(entry["bucket"])
        if entry.get("state") == "unavailable":
            unavailable.add(b)
            continue
        if not primary:
            continue  # never placed yet
        secondaries = tuple(
            normalize_url(addresses[s]) for s in entry.get("secondaries", []) if s in addresses
        )
        routes[b] = Route(b, normalize_url(primary), int(entry.get("epoch", 0)), secondaries)
    return Routing(
        int(table.get("version", 0)),
        routes,
        tuple(normalize_url(a) for a in addresses.values() if a),
        frozenset(unavailable),
    )


#: 'host:port' or a URL -> a URL without a trailing slash
normalize_url = base_url
