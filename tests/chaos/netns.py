"""Test hosts in network namespaces on one bridge, so a test can cut real links (issue 11).

Every host is a network namespace with one veth into a bridge (itself in a namespace of its
own), an address in 10.213.X.0/24 and loopback. The test process, in the root namespace, joins
the bridge too (host "client"), so it reaches every host as a client would. A cut between two
hosts makes each side drop, silently, what it sends to the other: an nftables set of cut
addresses in each namespace's output hook (Debian's `nftables`), so TCP sees a silent network as
with a pulled cable, and connections time out. Without `nft`, blackhole routes do the cut: the
sender then gets an immediate error instead of silence. Everything is deleted by `close()`;
deleting the bridge's namespace takes the root namespace's veth with it.

Needs root and iproute2 (`ip netns`); `available()` says whether this machine allows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=10, check=check)


def available() -> str | None:
    """None when namespaces can be made here, else why not."""
    if os.geteuid() != 0:
        return "needs root (ip netns)"
    probe = f"adamps-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"ip netns unavailable: {exc}"
    _ip("netns", "del", probe, check=False)
    return None


def free_subnet(start: int) -> str:
    """`10.213.X`: the first X from `start` (cyclically in 1..250) of which the root namespace
    holds no address."""
    held = _ip("-4", "-o", "addr", "show", check=False).stdout
    for i in range(250):
        x = (start - 1 + i) % 250 + 1
        if f" 10.213.{x}." not in held:
            return f"10.213.{x}"
    raise RuntimeError("every 10.213.X.0/24 is held in the root namespace (leaked test hosts?)")


class Net:
    """A bridge and hosts (namespaces) on it. Host names are short ([a-z0-9], <= 6 chars)."""

    def __init__(self, tag: str | None = None) -> None:
        # One /24 per test process: concurrent runs on one machine (pytest-xdist's workers) do
        # not collide. The tag is the pid's (unique among live processes); the subnet starts at
        # the pid's and skips any /24 the root namespace already holds (another run's client
        # address): two pids 250 apart would otherwise share one.
        self.tag = tag or f"a{os.getpid() % 100000}"
        self.subnet = free_subnet(os.getpid() % 250 + 1)
        self.bridge_ns = f"{self.tag}-br"
        self.hosts: dict[str, str] = {}  #: host -> address
        self._next = 10
        self._cuts: set[tuple[str, str]] = set()
        #: silent drops by nftables where installed, else blackhole routes
        self.nft = shutil.which("nft")
        self._tables: set[str] = set()  #: hosts whose namespace has the drop table
        _ip("netns", "add", self.bridge_ns)
        _ip("link", "set", "lo", "up", ns=self.bridge_ns)
        _ip("link", "add", "br0", "type", "bridge", ns=self.bridge_ns)
        _ip("link", "set", "br0", "up", ns=self.bridge_ns)
        self._attach("client", root=True)

    def ns(self, host: str) -> str | None:
        return None if host == "client" else f"{self.tag}-{host}"

    def _attach(self, host: str, root: bool = False) -> str:
        addr = f"{self.subnet}.{self._next}"
        self._next += 1
        outer, inner = f"{self.tag}{host}"[:15], f"b{self.tag}{host}"[:15]
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner)
        _ip("link", "set", inner, "netns", self.bridge_ns)
        _ip("link", "set", inner, "master", "br0", ns=self.bridge_ns)
        _ip("link", "set", inner, "up", ns=self.bridge_ns)
        if not root:
            ns = self.ns(host)
            _ip("netns", "add", ns)
            _ip("link", "set", outer, "netns", ns)
            _ip("link", "set", "lo", "up", ns=ns)
        else:
            ns = None
        _ip("addr", "add", f"{addr}/24", "dev", outer, ns=ns)
        _ip("link", "set", outer, "up", ns=ns)
        self.hosts[host] = addr
        return addr

    def add_host(self, host: str) -> str:
        """A new host on the bridge; returns its address."""
        return self._attach(host)

    def argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `host`'s namespace."""
        ns = self.ns(host)
        return list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]

    # -- faults ------------------------------------------------------------------------------

    def _nft(self, host: str, script: str) -> None:
        ns = self.ns(host)
        argv = [self.nft or "nft", "-f", "-"]
        if ns is not None:
            argv = ["ip", "netns", "exec", ns, *argv]
        subprocess.run(argv, input=script, text=True, timeout=10, check=True, capture_output=True)

    def _route(self, verb: str, a: str, b: str) -> None:
        if not self.nft:
            _ip("route", verb, "blackhole", f"{self.hosts[b]}/32", ns=self.ns(a), check=False)
            return
        table = f"adamps_{self.tag}"
        if a not in self._tables:
            self._nft(
                a,
                f"table inet {table} {{\n set cut {{ type ipv4_addr; }}\n"
                f" chain out {{ type filter hook output priority 0; policy accept;"
                f" ip daddr @cut drop; }}\n}}\n",
            )
            self._tables.add(a)
        op = "add" if verb == "add" else "delete"
        self._nft(a, f"{op} element inet {table} cut {{ {self.hosts[b]} }}\n")

    def cut(self, a: str, b: str) -> None:
        """No packet between hosts a and b, either way."""
        for x, y in ((a, b), (b, a)):
            if (x, y) not in self._cuts:
                self._route("add", x, y)
                self._cuts.add((x, y))

    def heal(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            if (x, y) in self._cuts:
                self._route("del", x, y)
                self._cuts.discard((x, y))

    def isolate(self, host: str, from_hosts: Sequence[str] | None = None) -> None:
        for other in from_hosts if from_hosts is not None else list(self.hosts):
            if other != host:
                self.cut(host, other)

    def heal_all(self) -> None:
        for x, y in list(self._cuts):
            self.heal(x, y)

    def close(self) -> None:
        if "client" in self._tables:  # the root namespace's table outlives the namespaces
            subprocess.run(
                [self.nft or "nft", "delete", "table", "inet", f"adamps_{self.tag}"],
                capture_output=True,
                timeout=10,
            )
        for host in self.hosts:
            ns = self.ns(host)
            if ns is not None:
                _ip("netns", "del", ns, check=False)
        _ip("netns", "del", self.bridge_ns, check=False)
        # The root end of the client's veth goes with its peer; make sure.
        _ip("link", "del", f"{self.tag}client"[:15], check=False)
