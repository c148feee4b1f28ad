"""The parameter server's configuration (TOML table ``[ps]``, env ``ADAMPS_PS_<FIELD>``, flags)."""

from __future__ import annotations

from dataclasses import dataclass

from adamps.config import default_token, field
from adamps.core.replication.settings import PINGS_PER_FAILOVER, ReplSettings
from adamps.layout import DEFAULT_BUCKETS, MAX_SHARD_ELEMS
from adamps.security import peer_auth
from adamps.security import token as tokens
from adamps.wire.web import HttpLimits


@dataclass
class PsConfig:
    host: str = field("127.0.0.1", help="address to listen on")
    port: int = field(7100, help="HTTP port")
    data_port: int = field(
        0,
        help="TCP port of the binary data plane (raw float32 push_dense/pull beside HTTP); 0 = off",
    )
    token: str = field(
        "", help="cluster token required on /rpc and /flush (Authorization: Bearer <token>)"
    )
    server_key: str = field(
        "",
        help="this server's own peer key, hex (also $ADAMPS_PS_SERVER_KEY; `adamps up` makes "
        "one per server): HMAC-SHA256(peer token, 'server' NUL server_id); with it the server "
        "gets its pairwise keys from the controllers and signs and checks every replication "
        "message (docs/operations.md, Security); empty = from peer_token, or peer identity off",
    )
    peer_token: str = field(
        "",
        help="the controllers' peer token (also $ADAMPS_PEER_TOKEN), when servers may hold it "
        "(one secret for a StatefulSet): the server derives its server_key from it; a server "
        "holding it could derive any server's key, so prefer server_key",
    )
    data_dir: str = field("./adamps-data/ps", help="directory of this server's LMDB environment")
    n_buckets: int = field(
        DEFAULT_BUCKETS, help="number of buckets of the layout (the same on every role)"
    )
    buckets: list[int] = field(
        [], help="buckets this server holds, comma separated (empty: all); the static bucket map"
    )
    max_shard_elems: int = field(
        MAX_SHARD_ELEMS, help="float32 elements per shard (1 MB by default)"
    )
    owner_threads: int = field(
        2, help="threads that apply updates; each shard belongs to exactly one"
    )
    blas_threads: int = field(1, help="BLAS threads per owner thread (threadpoolctl)")
    flush_interval: float = field(
        1.0, help="seconds between background flushes of dirty shards to LMDB"
    )
    flush_chunk_bytes: int = field(
        16 << 20,
        help="bytes a flush writes per LMDB transaction at most (whole buckets: a bucket larger "
        "than this is one transaction): a flush holds one chunk's copy, not the model's, and "
        "LMDB's file stays within the state + a few chunks (docs/operations.md)",
    )
    max_unflushed: float = field(
        0.0,
        help="seconds an update may stay unflushed (flushes failing or stalled) before this "
        "server stops acknowledging pushes (503 not_durable) and reports itself not durable; "
        "bounds what a crash of every copy can lose (docs/operations.md, Storage faults); "
        "0: 5 x flush_interval",
    )
    scrub_rate: int = field(
        4 << 20,
        help="bytes per second of LMDB records the background scrub verifies against their "
        "checksums at most (0: no scrub)",
    )
    scrub_cpu: float = field(
        0.005,
        help="fraction of one core the background scrub uses at most, measured as its thread's "
        "CPU time (0.005: 0.5%); with scrub_rate, whichever bound is tighter sets how long a "
        "pass takes (docs/operations.md, Storage faults)",
    )
    map_size: int = field(
        1 << 30, help="initial LMDB map size in bytes (grown by doubling when full)"
    )
    lmdb_sync: bool = field(
        True,
        help="fsync each flush transaction (off: faster, a crash of the machine may lose flushes)",
    )
    max_body: int = field(
        256 << 20, help="largest request body in bytes (413 beyond, also for chunked bodies)"
    )
    max_tensor_elems: int = field(
        1 << 26, help="most float32 elements of one tensor a create may define (256 MiB)"
    )
    max_server_elems: int = field(
        1 << 28,
        help="most float32 elements of all tensors' shards held here, and 4-byte counters of "
        "tables' frequency filters, checked at create and create_table (1 GiB; an optimizer's "
        "state adds 1x (Adagrad) to 3x (Adam with amsgrad) the memory)",
    )
    max_shards_per_request: int = field(
        4096, help="most shard ids (after removing duplicates) or tensors in one pull or push"
    )
    header_timeout: float = field(
        10.0, help="seconds an HTTP connection has to send a complete request head"
    )
    idle_timeout: float = field(30.0, help="seconds an idle keep-alive HTTP connection is kept")
    body_timeout: float = field(120.0, help="seconds a request body may take to arrive")
    max_connections: int = field(
        1024, help="open HTTP connections; beyond, the oldest idle one is closed"
    )
    tune_malloc: bool = field(
        True,
        help="raise glibc's mmap and trim thresholds at start so large bodies reuse heap memory",
    )
    controllers: list[str] = field(
        [],
        help="controller HTTP addresses (host:port, comma separated); empty: a standalone server "
        "on its static bucket map, else buckets, leases and replication come from the controllers",
    )
    server_id: str = field("", help="this server's id at the controllers (default: ps-PORT)")
    rack: str = field(
        "",
        help="this server's failure domain (also $ADAMPS_RACK), 1-64 characters of "
        "[A-Za-z0-9._:-]: servers that fail together (one rack, power feed or switch) share it, "
        "and the controllers keep a bucket's copies on distinct racks while enough exist; "
        "empty = a rack of its own",
    )
    advertise: str = field(
        "", help="host:port the peers and clients reach this server at (default: host:port)"
    )
    member_timeout: float = field(
        2.0,
        help="seconds a secondary may take to answer a replication message before the primary "
        "asks the controllers to drop it from the replica set",
    )
    ping_interval: float = field(
        0.0,
        help="seconds between the primary's heartbeats to the secondaries of its buckets "
        f"(0: failover_after / {PINGS_PER_FAILOVER}, as many as the failure detection needs)",
    )
    failover_after: float = field(
        3.0,
        help="seconds without a heartbeat from a bucket's primary after which a secondary "
        "proposes a role change to the controllers",
    )
    push_timeout: float = field(
        30.0,
        help="seconds a replicated push may wait for its rounds (then: timeout, outcome unknown)",
    )
    ack: str = field(
        "prepared",
        help="when a replicated push is acknowledged: 'prepared' (every member holds its batch "
        "and the primary applied it: the decision point of two-phase commit) or 'committed' "
        "(every member applied it too; one more round trip)",
    )
    replication_log: int = field(
        64,
        help="committed batches kept per bucket to catch up a lagging secondary without a snapshot",
    )
    clock_lease: float = field(
        10.0,
        help="consistency modes: seconds a replica's step clock counts as live after its last "
        "report; a dead replica stops holding the others back after this",
    )
    clock_wait: float = field(
        5.0,
        help="consistency modes: longest a clock request is held before it is answered 503 "
        "'unavailable' (the replica asks again)",
    )
    log_level: str = field("INFO", help="logging level")
    debug_ops: bool = field(
        False, help="enable the op debug_fail (raises on purpose; for tests only)"
    )

    def own_key(self) -> bytes | None:
        """S_X (adamps.security.peer_auth.server_key): from server_key, else derived from peer_token;
        None = peer identity off."""
        if self.server_key:
            return bytes.fromhex(self.server_key)
        if self.peer_token:
            return peer_auth.server_key(self.peer_token, self.server_id)
        return None

    @property
    def repl_settings(self) -> ReplSettings:
        """The replication core's settings (adamps.core.replication.settings) from these fields."""
        return ReplSettings(
            self.server_id,
            member_timeout=self.member_timeout,
            failover_after=self.failover_after,
            ping_interval=self.ping_interval,
            ack=self.ack,
            log_limit=self.replication_log,
        )

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.header_timeout, self.idle_timeout, self.body_timeout, self.max_connections
        )

    def __post_init__(self) -> None:
        self.token = tokens.resolve(self.token or default_token(), [self.host], "ps")
        if not self.server_id:
            self.server_id = f"ps-{self.port}"
        if self.rack and (
            len(self.rack) > 64
            or not all(c.isascii() and (c.isalnum() or c in "-_.:") for c in self.rack)
        ):
            raise ValueError(
                f"rack must be 1-64 characters of [A-Za-z0-9._:-], got {self.rack[:100]!r}"
            )
        if self.controllers and self.buckets:
            raise ValueError("buckets (a static map) and controllers exclude each other")
        if self.peer_token and (
            self.peer_token.strip() in tokens.WELL_KNOWN or self.peer_token == self.token
        ):
            raise ValueError(
                "peer_token is a well-known value or the cluster token; make a random one"
            )
        if self.server_key:
            try:
                if len(bytes.fromhex(self.server_key)) != 32:
                    raise ValueError
            except ValueError:
                raise ValueError(
                    "server_key must be 64 hex digits (HMAC-SHA256 of the peer token and the "
                    "server id), got something else"
                ) from None
        for name in ("member_timeout", "failover_after", "push_timeout"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.ping_interval < 0 or self.ping_interval >= self.failover_after:
            raise ValueError(
                f"ping_interval must be in [0, failover_after = {self.failover_after}) "
                f"(0: derived), got {self.ping_interval}"
            )
        if self.ping_interval == 0:
            # A secondary proposes a role change after failover_after without a ping: four
            # pings per window tolerate three lost or late ones; more only cost idle CPU.
            self.ping_interval = self.failover_after / PINGS_PER_FAILOVER
        if self.ack not in ("prepared", "committed"):
            raise ValueError(f"ack must be 'prepared' or 'committed', not {self.ack!r}")
        if self.replication_log < 1:
            raise ValueError("replication_log must be >= 1")
        if self.owner_threads < 1:
            raise ValueError("owner_threads must be >= 1")
        if self.n_buckets < 1:
            raise ValueError("n_buckets must be >= 1")
        bad = [b for b in self.buckets if not 0 <= b < self.n_buckets]
        if bad:
            raise ValueError(f"buckets {bad} out of range 0..{self.n_buckets - 1}")
        if self.flush_interval <= 0:
            raise ValueError("flush_interval must be > 0")
        if self.flush_chunk_bytes < 1 << 20:
            raise ValueError(f"flush_chunk_bytes must be >= 1 MiB, not {self.flush_chunk_bytes}")
        if self.max_unflushed < 0:
            raise ValueError("max_unflushed must be >= 0 (0: 5 x flush_interval)")
        if self.max_unflushed and self.max_unflushed <= self.flush_interval:
            raise ValueError(
                f"max_unflushed ({self.max_unflushed}) must exceed flush_interval "
                f"({self.flush_interval}): every update waits up to one interval for its flush"
            )
        if self.scrub_rate < 0:
            raise ValueError("scrub_rate must be >= 0 (0: no scrub)")
        if not 0 < self.scrub_cpu <= 1:
            raise ValueError(
                f"scrub_cpu must be a fraction of one core in (0, 1], not {self.scrub_cpu}"
            )
        for name in ("max_tensor_elems", "max_server_elems", "max_shards_per_request",
                     "max_shard_elems"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        HttpLimits(self.header_timeout, self.idle_timeout, self.body_timeout, self.max_connections)
        if self.max_body < 1024:
            raise ValueError("max_body must be >= 1024")
