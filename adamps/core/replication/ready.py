"""What a server's replication core asks its shell to do (etcd-io/raft's ``Ready``): a value the
shell reads with ``ReplCore.ready()``, carries out in order, then acknowledges with ``advance()``.

The order matters and is the same in every shell (the server's asyncio loop, the simulation):

1. ``forget`` and ``hold``: the store stops or starts keeping a bucket's shards;
2. ``applies``: batches to apply, in order per bucket, queued in the same step as the state
   changed (a flush cut or a snapshot then sees the values and the position together);
3. ``answers``: the waiters of client pushes, each ``ok`` (acknowledged) or ``unknown`` (the
   push may still be committed by another primary: the client retries with the same key);
4. ``messages`` to the replicas, ``requests`` to the controllers, state transfers to stop
   (``stop_joins``) and snapshots to fetch (``fetches``), ``heartbeat`` (the record is wanted
   now: the shell feeds ``want_record``) and the primary's ``pings`` to its replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from adamps.core.replication.values import Apply


@dataclass(frozen=True)
class Answer:
    """The outcome of one client push for its waiter."""

    waiter: Any
    #: "ok" (acknowledged) | "unknown" (outcome unknown to this server: the client retries)
    outcome: str
    bucket: int
    why: str = ""


@dataclass(frozen=True)
class ControllerRequest:
    """A call to make to the controllers; its answer, whatever it is, goes back in through
    ``ReplCore.controller_answer`` (controllers.py)."""

    #: "register" | "heartbeat" | "role_change" | "drop_secondary" | "caught_up" | "release"
    kind: str
    #: the bucket (-1 for register and heartbeat) and the epoch the request is about
    bucket: int
    epoch: int
    #: the member dropped or reported caught up (drop_secondary, caught_up)
    member: str = ""
    #: the controllers' id of the join reported (caught_up)
    join: int = 0
    #: this copy's [epoch, prepared seq] (role_change)
    position: tuple[int, int] = (0, 0)
    #: register: {"copies", "committed"}; heartbeat: {"known", "reports"}
    body: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ControllerAnswer:
    """The controllers' answer to a ``ControllerRequest``, as the transport got it."""

    #: the reply (None: refused, or no answer came)
    reply: Mapping[str, Any] | None = None
    #: the refusal's code, "connection" when no answer came; None: accepted
    error: str | None = None
    #: seconds the controllers said to wait before asking again (a refused role change)
    retry_after: float | None = None
    #: when the answered call was sent, on this server's clock (a heartbeat's renewed leases
    #: are timed from it)
    asked_at: float = 0.0


@dataclass(frozen=True)
class Send:
    """A message of this primary to a replica (repl_prepare, repl_commit). Its answer goes back
    in as ``ReplCore.answer(rid, reply, None, now)``, its failure as ``answer(rid, None, error,
    now)``: the transport answers every message once. Whether it came in time is the core's to
    decide: unanswered at its deadline, the core's tick fails it (deadlines.py) and ignores
    what the transport reports of it later (its safety timeout only frees the socket)."""

    rid: int
    peer: str
    op: str
    #: the message's fields, with ``entries`` as Batch values (the transport encodes them)
    fields: dict[str, Any]


@dataclass(frozen=True)
class Fetch:
    """A snapshot for a joining copy to fetch from its primary. The shell fetches it, feeds the
    answer back (``ReplCore.snapshot_fetched``: True means install it now, then ``installed``
    and ``install_persisted``), or reports it damaged (``snapshot_corrupt``)."""

    bucket: int
    primary: str
    epoch: int
    #: the controllers' id of this copy's join (named in the snapshot request)
    join: int
    #: this fetch's id: an answer to an earlier one is ignored
    fid: int


@dataclass
class Ready:
    """Everything the core decided since the last ``advance()``."""

    forget: list[int] = field(default_factory=list)
    hold: list[int] = field(default_factory=list)
    applies: list[tuple[int, Apply]] = field(default_factory=list)
    answers: list[Answer] = field(default_factory=list)
    requests: list[ControllerRequest] = field(default_factory=list)
    #: snapshots to fetch (joining copies), and buckets whose state transfer stops
    fetches: list[Fetch] = field(default_factory=list)
    stop_joins: list[int] = field(default_factory=list)
    #: messages to the replicas of this server's primary buckets
    messages: list[Send] = field(default_factory=list)
    #: (seconds, pushes) of every round decided (for the metrics)
    rounds: list[tuple[float, int]] = field(default_factory=list)
    #: ask the controllers for the record now (an epoch seen that this server does not know)
    heartbeat: bool = False
    #: the pings due now, member -> {bucket: epoch} (pings.py); None: not the time
    pings: dict[str, dict[str, int]] | None = None
    #: counters for the metrics: failovers (promotions), stale (messages of an older epoch),
    #: duplicates (a push's buckets that already had it: answered once, never applied twice)
    failovers: int = 0
    stale: int = 0
    duplicates: int = 0

    def empty(self) -> bool:
        return not (
            self.forget
            or self.hold
            or self.applies
            or self.answers
            or self.requests
            or self.fetches
            or self.stop_joins
            or self.messages
            or self.rounds
            or self.heartbeat
            or self.pings is not None
            or self.failovers
            or self.stale
            or self.duplicates
        )
