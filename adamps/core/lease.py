"""Primary leases: the rules both sides follow, pure (time is always an argument).

Project Adam 3.3.3: the controller hands the primary role of a bucket to one parameter server via a
lease and persists it in its replicated state; on failure it grants a new lease to a secondary.
A lease is (holder, epoch, duration). The epoch only grows: it is the fencing token every
replicated batch carries, so a secondary refuses batches of an older primary.

Two clocks, two rules, one safety argument:

* The controller records `renewed_at` (the proposing leader's wall clock, passed into the
  replicated method) for every committed grant or renewal. It grants the bucket to someone else
  only once the lease has *certainly* expired: `renewed_at + duration * (1 + skew) + margin`
  (or the holder released it). `skew` bounds the relative rate error of any clock involved;
  `margin` absorbs the controllers' wall-clock disagreement across a leader change.
* The holder times its lease on its own monotonic clock from when it *asked* for the renewal
  (before the controller could commit it, so never later than `renewed_at` in real time), and
  shortens it by the skew: it writes as primary only while
  `asked_at + duration * (1 - skew) > now`.

So the holder stops writing before the controller may grant the next epoch, whatever the
message delays. `check_history` verifies exactly that over a committed record of grants.

Renewals batched into one entry (issue 40: one Raft entry per renewal round for all servers,
not one per heartbeat) keep the argument: the leader proposes the round's entry after it
received every heartbeat the round renews, with its clock read then, so each holder's
`asked_at` (before its heartbeat was sent) is still no later than the `renewed_at` recorded
for it. A heartbeat answered by a round's entry that was proposed before the heartbeat arrived
would break it; the leader never does so (a heartbeat that arrives while a round is in flight
waits for the next round: `controller/renewals.py`).

Leases renewed per server (issue 40: a round's cost follows the servers, not the buckets) keep
it too. The controllers record one renewal time per server and round; a bucket's lease takes
its holder's renewal time only from the first round after it started *following* the holder
(held by the holder's current incarnation, unreleased, no hand-off pending), and when it stops
following, the time of the last round that renewed it is frozen into its `renewed_at`
(`controller/server_leases.py`). The round's answer lists, as `renewed`, exactly the leases that
follow the server, computed in the same entry. So for every lease a holder is told renewed, the
controller's `renewed_at` is at least that round's clock, read after the holder asked; and a
lease the holder is not told about is not extended on either side (the holder's deadline for
it stays that of the last round that listed it, and the controller's `renewed_at` for it stays
that round's clock). The argument above holds lease by lease, unchanged
(tests/core/test_server_leases.py, tests/core/test_lease_rounds.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any


class LeaseError(ValueError):
    """A lease operation that the rules forbid (the message says which rule)."""


@dataclass(frozen=True)
class LeaseTerms:
    """How long leases last and how much clock error they tolerate (the same on every node)."""

    #: Seconds a grant or renewal is valid for, as the holder sees it before the skew cut.
    duration: float = 5.0
    #: Relative clock-rate error tolerated (0.1 = a clock may run 10% fast or slow).
    skew: float = 0.1
    #: Extra seconds the controller waits before re-granting (wall-clock disagreement).
    margin: float = 0.5

    def __post_init__(self) -> None:
        if not self.duration > 0:
            raise ValueError("lease duration must be > 0")
        if not 0 <= self.skew < 1:
            raise ValueError("lease skew must be in [0, 1)")
        if self.margin < 0:
            raise ValueError("lease margin must be >= 0")

    def certain_expiry(self, renewed_at: float) -> float:
        """When the controller may treat a lease last renewed at `renewed_at` as expired."""
        return renewed_at + self.duration * (1 + self.skew) + self.margin

    def holder_deadline(self, asked_at: float) -> float:
        """Until when (holder's monotonic clock) a holder that asked at `asked_at` may write."""
        return asked_at + self.duration * (1 - self.skew)

    def to_dict(self) -> dict[str, float]:
        return {"duration": self.duration, "skew": self.skew, "margin": self.margin}


@dataclass(frozen=True)
class Lease:
    """One primary lease of a bucket as the controller records it (committed state)."""

    holder: str
    epoch: int
    granted_at: float
    renewed_at: float
    duration: float
    #: Set when the holder gave the lease back (it stopped writing before asking).
    released_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "holder": self.holder,
            "epoch": self.epoch,
            "granted_at": self.granted_at,
            "renewed_at": self.renewed_at,
            "duration": self.duration,
            "released_at": self.released_at,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Lease:
        return cls(
            holder=str(d["holder"]),
            epoch=int(d["epoch"]),
            granted_at=float(d["granted_at"]),
            renewed_at=float(d["renewed_at"]),
            duration=float(d["duration"]),
            released_at=None if d.get("released_at") is None else float(d["released_at"]),
        )


def expired(lease: Lease | None, now: float, terms: LeaseTerms) -> bool:
    """True when nobody can still be writing under `lease` at `now` (controller side)."""
    if lease is None:
        return True
    if lease.released_at is not None:
        return now >= lease.released_at
    return now >= terms.certain_expiry(lease.renewed_at)


def expires_at(lease: Lease | None, terms: LeaseTerms) -> float:
    """When `lease` certainly ends (controller side); -inf for no lease."""
    if lease is None:
        return float("-inf")
    if lease.released_at is not None:
        return lease.released_at
    return terms.certain_expiry(lease.renewed_at)


def grant(prev: Lease | None, holder: str, now: float, terms: LeaseTerms) -> Lease:
    """A new lease for `holder` with the next epoch; refused while `prev` may be in use."""
    if not expired(prev, now, terms):
        raise LeaseError(
            f"lease epoch {prev.epoch} of {prev.holder} may still be in use until "  # type: ignore[union-attr]
            f"{expires_at(prev, terms):.3f} (now {now:.3f})"
        )
    epoch = 1 if prev is None else prev.epoch + 1
    return Lease(
        holder=holder, epoch=epoch, granted_at=now, renewed_at=now, duration=terms.duration
    )


def renew(lease: Lease, holder: str, epoch: int, now: float) -> Lease:
    """The lease renewed at `now`; only its holder, at its epoch, and before it was released."""
    if lease.holder != holder or lease.epoch != epoch:
        raise LeaseError(
            f"{holder} does not hold epoch {epoch} (holder {lease.holder}, epoch {lease.epoch})"
        )
    if lease.released_at is not None:
        raise LeaseError(f"lease epoch {epoch} was released")
    # The replicated clock never goes back: a renewal never shortens a lease.
    if now <= lease.renewed_at:
        return lease
    # `replace` without its field-by-field checks: 100,000 leases renewed every second are
    # most of the controller's steady-state work (issue 40's scale simulation).
    new = object.__new__(Lease)
    new.__dict__.update(lease.__dict__)
    new.__dict__["renewed_at"] = now
    return new


def release(lease: Lease, holder: str, epoch: int, now: float) -> Lease:
    """The holder gives its lease back (it has already stopped writing)."""
    if lease.holder != holder or lease.epoch != epoch:
        raise LeaseError(
            f"{holder} does not hold epoch {epoch} (holder {lease.holder}, epoch {lease.epoch})"
        )
    if lease.released_at is not None:
        return lease
    return replace(lease, released_at=max(now, lease.renewed_at))


# -- holder side ------------------------------------------------------------------------------


class HolderLeases:
    """What a parameter server may do as primary, per bucket, on its own monotonic clock.

    Owned by one PS; not thread-safe (the PS's control loop owns it). Usage: take `asked_at =
    monotonic()` *before* sending the heartbeat/renewal request, and on the reply call
    `on_granted(bucket, epoch, asked_at)` for every lease the reply confirms as committed.
    """

    def __init__(self, terms: LeaseTerms) -> None:
        self.terms = terms
        #: bucket -> (epoch, deadline on the holder's monotonic clock)
        self._held: dict[int, tuple[int, float]] = {}

    def on_granted(self, bucket: int, epoch: int, asked_at: float) -> None:
        """A committed grant or renewal of `epoch` for `bucket`, asked for at `asked_at`."""
        old = self._held.get(bucket)
        if old is not None and old[0] > epoch:
            return  # a late reply about an older epoch never resurrects it
        deadline = self.terms.holder_deadline(asked_at)
        if old is not None and old[0] == epoch:
            deadline = max(deadline, old[1])
        self._held[bucket] = (epoch, deadline)

    def drop(self, bucket: int) -> None:
        """Stop acting as primary of `bucket` (lost the role, releasing, or shutting down)."""
        self._held.pop(bucket, None)

    def can_write(self, bucket: int, epoch: int, now: float) -> bool:
        """True while this PS holds `epoch` of `bucket` and the lease is unexpired at `now`."""
        held = self._held.get(bucket)
        return held is not None and held[0] == epoch and now < held[1]

    def epoch(self, bucket: int) -> int | None:
        held = self._held.get(bucket)
        return None if held is None else held[0]

    def deadline(self, bucket: int) -> float | None:
        held = self._held.get(bucket)
        return None if held is None else held[1]


# -- checking a committed record ---------------------------------------------------------------


def check_history(records: Iterable[Mapping[str, Any]], terms: LeaseTerms) -> list[str]:
    """Violations of lease safety in a committed record of leases (empty list = safe).

    `records` are Lease dicts with a "bucket" key, in any order. For every bucket, epochs must
    strictly grow in grant order, and each grant must start no earlier than the previous lease's
    certain expiry, so no two primary leases of a bucket overlap in time, holder clocks included.
    """
    by_bucket: dict[int, list[Lease]] = {}
    for r in records:
        by_bucket.setdefault(int(r["bucket"]), []).append(Lease.from_dict(r))
    problems: list[str] = []
    for bucket, leases in sorted(by_bucket.items()):
        leases.sort(key=lambda lease: lease.epoch)
        for a, b in zip(leases, leases[1:], strict=False):
            if b.epoch == a.epoch:
                problems.append(f"bucket {bucket}: epoch {a.epoch} granted twice")
            if b.granted_at < a.granted_at:
                problems.append(f"bucket {bucket}: epoch {b.epoch} granted before epoch {a.epoch}")
            if b.granted_at < expires_at(a, terms):
                problems.append(
                    f"bucket {bucket}: epoch {b.epoch} ({b.holder}) granted at {b.granted_at:.3f} while "
                    f"epoch {a.epoch} ({a.holder}) could be in use until {expires_at(a, terms):.3f}"
                )
    return problems
