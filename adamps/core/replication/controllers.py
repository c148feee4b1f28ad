"""The replication core's side of the controllers (no IO, no clock): when to register and
heartbeat (the link, adamps.core.replication.controller_link), what each call says, and what every answer
does. Part of ``ReplCore`` (adamps.core.replication.node), which holds the state these methods read.

Every call is a ``ControllerRequest`` in the ``Ready``: ``register`` (this server's copies and
their positions, read after it stopped acting on every role, so they are final), ``heartbeat``
(the record version it knows, that it applies the roles changed since as a delta, and, per copy,
its epoch and prepared seq), and the calls the
protocol asks for (``role_change``, ``drop_secondary``, ``caught_up``), and at stop the primary
leases given back (``release``, ``stopping``). The transport makes each
call once and feeds its answer back, whatever it is (``controller_answer``): the reply, or the
refusal's code, or "connection" when none came."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adamps.core.lease import HolderLeases, LeaseTerms
from adamps.core.replication.bucket import BucketReplica
from adamps.core.replication.controller_link import HEARTBEAT, REGISTER, ControllerLink
from adamps.core.replication.ready import ControllerAnswer, ControllerRequest, Ready
from adamps.core.replication.settings import ReplSettings
from adamps.core.replication.values import Assignment

#: controller error codes after which a caught-up report's outcome is unknown (the entry may have
#: committed): the report is sent again, never taken as a refusal
UNKNOWN_OUTCOME = frozenset({"no_quorum", "timeout", "unavailable", "internal"})
#: a heartbeat refused with these: the controllers declared this server dead (register at once)
DECLARED_DEAD = frozenset({"conflict", "not_found"})


class ControllerSide:
    """The controller-facing methods of ``ReplCore``."""

    settings: ReplSettings
    buckets: dict[int, BucketReplica]
    roles: dict[int, str]
    leases: HolderLeases
    table_version: int | None
    link: ControllerLink
    _ready: Ready
    _rounds: dict[int, Any]
    _rids: dict[int, tuple[int, str]]
    _accepted: dict[int, dict[str, float]]
    _report_again: dict[tuple[int, str], tuple[float, ControllerRequest]]
    role_change_after: dict[int, float]

    def on_roles(self, reply: Mapping[str, Any], asked_at: float, now: float) -> None: ...
    def _unknown(self, waiters: Any, b: int, why: str) -> None: ...

    def _link_tick(self, now: float) -> None:
        """The registration or heartbeat due now (one in flight at a time), as a request."""
        call = self.link.tick(now)
        if call == REGISTER:  # no role is acted on from here: the positions offered are final
            self.unregistered()
            committed = {b: rep.committed for b, rep in self.buckets.items()}
            body = {"copies": self.offered(), "committed": committed}
            self._ready.requests.append(ControllerRequest(REGISTER, -1, 0, body=body))
        elif call == HEARTBEAT:
            # deltas: the answer's roles may be those changed since `known` (issue 40)
            body = {
                "known": self.table_version,
                "reports": self.heartbeat_reports(),
                "deltas": True,
            }
            self._ready.requests.append(ControllerRequest(HEARTBEAT, -1, 0, body=body))

    def want_record(self, now: float) -> None:
        """The record wanted now (``Ready.heartbeat``): a heartbeat at once, or as soon as the
        one in flight is answered."""
        self.link.want_record()
        if self.link.registered:
            self._link_tick(now)

    def stopping(self) -> list[ControllerRequest]:
        """This server stops: a release of each primary lease it holds, so that the next
        primaries need not wait for them to run out (best effort: the answers change nothing)."""
        return [
            ControllerRequest("release", b, self.buckets[b].assignment.epoch)
            for b, role in self.roles.items()
            if role == "primary"
        ]

    def registered(self, terms: LeaseTerms) -> None:
        """A new incarnation at the controllers: no role and no lease is trusted any more, but the
        copies stay (they were offered) until the roles say what to do with them."""
        self.unregistered()
        self.leases = HolderLeases(terms)

    def unregistered(self) -> None:
        """This server is about to register again (the controllers declared it dead, or could not
        be reached): it stops acting on every role now, before it offers its copies, so that the
        positions it offers are final. (A primary that went on committing rounds between its
        offer and the answer would hold batches the controllers' comparison did not see.)"""
        self.leases = HolderLeases(self.leases.terms)
        self._rounds.clear()
        self._rids.clear()
        for b, rep in self.buckets.items():
            self._unknown(
                rep.on_assignment(Assignment(rep.assignment.epoch, None)),
                b,
                "this server registered again; the push's outcome is unknown",
            )
            if self.roles.get(b) != "joining" or rep.learning:
                self.roles[b] = "standby"
        self.table_version = None

    def holds(self, b: int, rep: BucketReplica) -> bool:
        """Whether the copy of bucket b is whole (a joining copy without its snapshot is not)."""
        return self.roles.get(b) != "joining" or rep.learning

    def offered(self) -> dict[int, list[int]]:
        """The copies held whole, with the (epoch, seq) of the newest batch held applied or
        prepared: what this server offers the controllers when it registers."""
        return {b: list(r.held_position) for b, r in self.buckets.items() if self.holds(b, r)}

    def heartbeat_reports(self) -> dict[int, list[int]]:
        """Per copy, [epoch it knows, prepared seq]: what each heartbeat tells the controllers."""
        return {b: [rep.assignment.epoch, rep.prepared_seq] for b, rep in self.buckets.items()}

    def controller_answer(self, req: ControllerRequest, ans: ControllerAnswer, now: float) -> None:
        """The controllers' answer to `req`, as the transport got it."""
        if req.kind == REGISTER:
            if ans.error is not None or ans.reply is None:
                self.link.on_failed(now)  # unreachable: register again after the link's retry
                return
            self.link.on_registered(ans.reply.get("heartbeat_interval"), now)
            terms = ans.reply.get("lease") or {}
            self.registered(LeaseTerms(**{k: float(v) for k, v in terms.items()}))
        elif req.kind == HEARTBEAT:
            if ans.error is not None or ans.reply is None:  # dead or unreachable: register again
                self.link.on_failed(now, declared_dead=ans.error in DECLARED_DEAD)
                return
            self.link.on_heartbeat(now)
            self.on_roles(ans.reply, ans.asked_at, now)
        elif req.kind == "role_change":  # a refusal may say when to propose again
            if ans.retry_after:
                self.role_change_after[req.bucket] = now + float(ans.retry_after)
            self._ready.heartbeat = True
        elif req.kind == "caught_up":
            self.on_caught_up_answer(req, ans.error, now)
        elif req.kind == "drop_secondary":  # the record without the member: the rounds wait
            self._ready.heartbeat = True

    def on_caught_up_answer(self, req: ControllerRequest, error: str | None, now: float) -> bool:
        """The controllers' answer to a caught-up report (`error`: None if accepted, else its
        code, "connection" when none came). True when the report is sent again (in the
        ``Ready`` of the first ``tick`` ``report_retry`` later): its outcome is unknown (the
        entry may have committed, and a repeated report of one join is accepted), and the
        record has not moved on without this primary or this join."""
        self._ready.heartbeat = True
        rep = self.buckets.get(req.bucket)
        if (
            rep is None
            or rep.assignment.epoch != req.epoch
            or not rep.is_primary
            or rep.learners.get(req.member) != "reporting"
            or rep.learner_joins.get(req.member, 0) != req.join
        ):
            # The record moved on (on_assignment settles the learner), or the copy joined
            # again meanwhile: that join's own report decides, not this older one's answer.
            return False
        if error is not None and (error == "connection" or error in UNKNOWN_OUTCOME):
            self._report_again[req.bucket, req.member] = (now + self.settings.report_retry, req)
            return True
        rep.report_done(req.member, error is None)
        if error is None:
            self._accepted.setdefault(req.bucket, {})[req.member] = now
        return False
