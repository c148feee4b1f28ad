"""The settings of a server's replication core: one frozen value, filled by the shell from the
server's configuration (adamps.server.config.PsConfig) or by the simulation from its own timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from adamps.core.lease import LeaseTerms
from adamps.core.replication.bucket import DEFAULT_LOG_LIMIT

#: a server's default ping_interval is failover_after / this (adamps.server.config)
PINGS_PER_FAILOVER = 4
#: bytes per second a live peer takes at least: a message gets member_timeout plus its size at
#: this rate (and that of the messages queued to the same peer before it: deadlines.py)
RATE_FLOOR = 32e6


@dataclass(frozen=True)
class ReplSettings:
    #: this server's id (what the controllers' records name)
    server_id: str
    #: seconds a member has to answer a message (beyond its bytes at rate_floor: deadlines.py)
    #: before the primary asks the controllers to drop it
    member_timeout: float = 1.0
    #: bytes per second a live peer takes at least (a message's size allowance)
    rate_floor: float = RATE_FLOOR
    #: seconds a secondary waits without a word from its primary before proposing a role change
    failover_after: float = 3.0
    #: "prepared": acknowledge at the decision point of 2PC; "committed": once every member committed
    ack: str = "prepared"
    #: committed batches kept per bucket for lagging members (older gaps need a state transfer)
    log_limit: int = DEFAULT_LOG_LIMIT
    #: seconds between a primary's pings to the replicas of its buckets
    ping_interval: float = 0.3
    #: seconds before a joining copy asks for a snapshot again after a failed or unfitting one
    join_retry: float = 0.3
    #: seconds before a joining copy that cannot persist looks again (issue 29)
    persist_retry: float = 1.0
    #: seconds before a caught-up report whose outcome is unknown is sent again
    report_retry: float = 0.2
    #: seconds before registering again after the controllers could not be reached
    link_retry: float = 0.5
    #: the controllers' lease terms (replaced at each registration by what they announce)
    lease: LeaseTerms = field(default_factory=LeaseTerms)

    def __post_init__(self) -> None:
        if self.ack not in ("prepared", "committed"):
            raise ValueError(f"ack must be 'prepared' or 'committed', not {self.ack!r}")
