"""Configuration of one controller node (`adamps controller`), section [controller]."""

from __future__ import annotations

from dataclasses import dataclass

from adamps.config import ConfigError, default_token, field
from adamps.core.lease import LeaseTerms
from adamps.security import token as tokens
from adamps.wire.web import HttpLimits
from controller.raft_timing import append_period
from controller.raft_transport import RaftLimits


@dataclass
class ControllerConfig:
    members: list[str] = field(
        ["127.0.0.1:7010:7000"],
        help="every controller of the cluster as HOST:RAFT_PORT:HTTP_PORT, the same list on every node",
    )
    member: int = field(0, help="index of this node in --members")
    bind_host: str = field(
        "",
        help="interface to listen on (HTTP and Raft; --bind-host is the same flag); empty = the "
        "member's host",
        flags=("--host", "--bind-host"),
    )
    data_dir: str = field(
        "",
        help="directory of the Raft journal and full dump (one per node); empty = run/controller-MEMBER",
    )
    token: str = field(
        "", help="cluster token for mutating calls and (derived) the Raft port's password"
    )
    raft_password: str = field(
        "",
        help="password of the Raft port (pickled traffic!); empty = derived from the peer token "
        "if set, else from the cluster token (which every trainer holds)",
    )
    peer_token: str = field(
        "",
        help="secret of the controllers alone (also $ADAMPS_PEER_TOKEN): from it each server's "
        "own key (its server_key) and the pairwise keys that authenticate replication messages "
        "(docs/operations.md, Security); empty = replication ops are authenticated by the "
        "cluster token only",
    )
    n_buckets: int = field(64, help="number of buckets (must equal the model layout's)")
    replication: int = field(3, help="copies of each bucket: one primary plus secondaries")
    min_servers: int = field(1, help="parameter servers to wait for before the first placement")
    lease_duration: float = field(5.0, help="seconds a primary lease grant or renewal lasts")
    lease_skew: float = field(0.1, help="relative clock-rate error tolerated by the lease rules")
    lease_margin: float = field(
        0.5, help="extra seconds before a lease may be re-granted (wall-clock spread)"
    )
    heartbeat_interval: float = field(
        1.0, help="seconds between a parameter server's heartbeats (told at register)"
    )
    server_timeout: float = field(3.0, help="silence after which the leader declares a server dead")
    reconcile_interval: float = field(
        0.25, help="seconds between the leader's checks for failures and due grants"
    )
    commit_timeout: float = field(
        2.0, help="seconds to wait for a write to commit before answering no_quorum"
    )
    election_min: float = field(
        0.6,
        help="Raft election timeout, lower bound (seconds); the leader's heartbeats come four "
        "times as often (docs/operations.md, What an idle cluster costs)",
    )
    election_max: float = field(1.4, help="Raft election timeout, upper bound (seconds)")
    leader_fallback: float = field(
        1.0, help="a leader hearing from no majority this long steps down"
    )
    compaction_entries: int = field(
        5000, help="compact the Raft log (full dump) after this many entries"
    )
    compaction_seconds: float = field(300.0, help="... or after this many seconds")
    max_body: int = field(
        4 << 20, help="largest request body accepted (bytes); a layout of 4096 tensors is < 1 MiB"
    )
    max_layout_tensors: int = field(4096, help="most tensors in a model layout (PUT /layout)")
    max_tensor_elems: int = field(
        1 << 26, help="most float32 elements of one tensor of the layout (256 MiB)"
    )
    max_layout_elems: int = field(
        1 << 32, help="most float32 elements of the whole layout (16 GiB over all servers)"
    )
    max_layout_shards: int = field(1 << 20, help="most shards of the whole layout")
    max_servers: int = field(
        1024, help="most server records kept (live + dead); more registrations are refused"
    )
    dead_server_ttl: float = field(
        600.0, help="seconds after which a dead server that holds no bucket copy is forgotten"
    )
    raft_preauth_limit: int = field(
        64 << 10,
        help="largest frame (bytes) a peer may announce on the Raft port before it proved the password",
    )
    raft_max_message: int = field(
        64 << 20, help="largest frame (bytes) of an authenticated Raft peer"
    )
    raft_max_unauthenticated: int = field(
        16,
        help="Raft connections allowed to be unauthenticated at once (a new one closes the oldest)",
    )
    raft_auth_timeout: float = field(
        5.0, help="seconds a Raft connection may stay unauthenticated before it is closed"
    )
    header_timeout: float = field(
        10.0, help="seconds an HTTP connection has to send a complete request head"
    )
    idle_timeout: float = field(30.0, help="seconds an idle keep-alive HTTP connection is kept")
    body_timeout: float = field(60.0, help="seconds a request body may take to arrive")
    max_connections: int = field(
        512, help="open HTTP connections; beyond, the oldest idle one is closed"
    )
    checkpoint_interval: float = field(
        0.0,
        help="seconds between periodic checkpoints taken by the leader; 0 = none",
    )
    checkpoint_keep: int = field(
        3, help="periodic checkpoints kept (older ones are pruned, files still named are kept)"
    )
    checkpoint_consistent: bool = field(
        False,
        help="periodic checkpoints cut every bucket at one instant (writes held for the copy, "
        "as adamps checkpoint save --consistent)",
    )
    checkpoint_dir: str = field(
        "",
        help="directory of the periodic checkpoints, the same on every controller (a shared "
        "file system when they run on several machines); needed with checkpoint_interval",
    )
    log_level: str = field("INFO", help="logging level")

    def __post_init__(self) -> None:
        if not self.members:
            raise ConfigError("controller.members is empty")
        for m in self.members:
            parse_member(m)
        if not 0 <= self.member < len(self.members):
            raise ConfigError(
                f"controller.member {self.member} is not an index of members ({len(self.members)})"
            )
        if self.n_buckets <= 0 or self.replication <= 0 or self.min_servers < 0:
            raise ConfigError("controller.n_buckets and replication must be > 0, min_servers >= 0")
        if not 0 < self.election_min < self.election_max:
            raise ConfigError("controller: need 0 < election_min < election_max")
        if self.server_timeout <= self.heartbeat_interval:
            raise ConfigError("controller.server_timeout must exceed heartbeat_interval")
        # Checked here, not when the service builds them: a lease_skew of 5 or an idle_timeout
        # of 0 passed the configuration and stopped the controller with a traceback.
        try:
            LeaseTerms(self.lease_duration, self.lease_skew, self.lease_margin)
            self.http_limits  # noqa: B018 - its checks
        except ValueError as exc:
            raise ConfigError(f"controller: {exc}") from None
        for name in ("heartbeat_interval", "compaction_seconds"):
            if not getattr(self, name) > 0:  # pysyncobj asserts on compaction_seconds
                raise ConfigError(f"controller.{name} must be > 0, got {getattr(self, name)}")
        # pysyncobj's own assertions, as a message (they stopped the controller with a bare
        # AssertionError)
        if not self.leader_fallback > append_period(self.election_min):
            raise ConfigError(
                f"controller.leader_fallback must exceed the leader's append period "
                f"({append_period(self.election_min):g} s: election_min / 4), got "
                f"{self.leader_fallback}"
            )
        if self.compaction_entries < 2:
            raise ConfigError(
                f"controller.compaction_entries must be >= 2, got {self.compaction_entries}"
            )
        if self.checkpoint_interval < 0 or self.checkpoint_keep < 1:
            raise ConfigError(
                "controller: need checkpoint_interval >= 0 and checkpoint_keep >= 1, got "
                f"{self.checkpoint_interval} and {self.checkpoint_keep}"
            )
        if self.checkpoint_interval > 0 and not self.checkpoint_dir:
            raise ConfigError(
                "controller.checkpoint_interval is set but checkpoint_dir is empty: name the "
                "directory the periodic checkpoints go to"
            )
        if not self.data_dir:
            self.data_dir = f"run/controller-{self.member}"
        # Loopback-only means every member (their Raft and HTTP ports) and the bind address.
        hosts = [parse_member(m)[0] for m in self.members] + (
            [self.bind_host] if self.bind_host else []
        )
        self.token = tokens.resolve(self.token or default_token(), hosts, "controller")
        if self.peer_token and (
            self.peer_token.strip() in tokens.WELL_KNOWN or self.peer_token == self.token
        ):
            raise ConfigError(
                "controller.peer_token is a well-known value or the cluster token; make a "
                "random one"
            )
        if self.raft_password.strip() in tokens.WELL_KNOWN:
            raise ConfigError("controller.raft_password is a well-known value; make a random one")

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.header_timeout, self.idle_timeout, self.body_timeout, self.max_connections
        )

    @property
    def raft_limits(self) -> RaftLimits:
        return RaftLimits(
            self.raft_preauth_limit,
            max(self.raft_max_message, 2 * self.max_body),
            self.raft_max_unauthenticated,
            self.raft_auth_timeout,
        )

    @property
    def password(self) -> str:
        if self.raft_password:
            return self.raft_password
        if self.peer_token:  # not derivable by a trainer, who holds the cluster token only
            return "adamps-raft-peer:" + self.peer_token
        return "adamps-raft:" + self.token

    @property
    def raft_addresses(self) -> list[str]:
        return [f"{h}:{rp}" for h, rp, _ in map(parse_member, self.members)]

    @property
    def http_addresses(self) -> list[str]:
        return [f"{h}:{hp}" for h, _, hp in map(parse_member, self.members)]

    @property
    def self_host(self) -> str:
        return parse_member(self.members[self.member])[0]

    @property
    def http_port(self) -> int:
        return parse_member(self.members[self.member])[2]


def parse_member(text: str) -> tuple[str, int, int]:
    """'host:raft_port:http_port' -> (host, raft_port, http_port)."""
    parts = text.rsplit(":", 2)
    if len(parts) != 3:
        raise ConfigError(f"controller member {text!r}: expected HOST:RAFT_PORT:HTTP_PORT")
    host, rp, hp = parts
    try:
        return host, int(rp), int(hp)
    except ValueError:
        raise ConfigError(f"controller member {text!r}: ports must be integers") from None
