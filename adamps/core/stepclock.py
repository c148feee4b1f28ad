"""Consistency modes (issue 25): the step clocks of a run's replicas and the rule that releases a
replica's fetch of its next step. Pure: time enters as ``now``; no IO, no clock.

A replica's *clock* is the last step whose push every server acknowledged; it reports it to
every parameter server after that push (op ``clock``, adamps/server/api/clockops.py) and fetches the
parameters for step ``c + 1`` once its server releases it. Clocks are kept in *ticks*, two per
step: ``2t`` once step t's push is acknowledged ("pushed"), ``2t + 1`` once the parameters for
step t + 1 are fetched ("fetched"; only sync reports it, see below).

- ``async``: at once (Downpour; replicas in this mode do not report at all);
- ``ssp:S``: once the slowest live replica's clock is at least ``c - S`` (stale synchronous
  parallel: no replica more than S steps ahead of the slowest);
- ``sync``: once every live replica's gradients for step ``c`` are applied, so that every
  replica fetches step ``c + 1`` from the same sum; and a replica computes step ``c + 1`` once
  every live replica fetched for it, so that no push of step ``c + 1`` reaches a server before
  every replica has read the parameters it is computed from (bulk-synchronous SGD: two
  barriers a step, one on each tick).

A replica is *live* while it reported within ``lease`` seconds: a dead one stops blocking the
others after its lease. A replica that joins a running run starts at the slowest live clock (it
does not hold everybody back to step 0); a run declared with ``expect`` replicas holds its
first step until they joined or their lease passed (a synchronous run starts together).

*Staleness* of a released fetch: ``c - min(live clocks)``, the steps of the slowest replica's
updates the fetched parameters may lack; under ``ssp:S`` never above S, under ``sync`` 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_BOUND = 1 << 20


@dataclass(frozen=True)
class Mode:
    """A consistency mode: ``kind`` async | ssp | sync, ``bound`` S (0 for sync)."""

    kind: str
    bound: int = 0

    def __str__(self) -> str:
        return f"ssp:{self.bound}" if self.kind == "ssp" else self.kind


def parse_mode(text: str) -> Mode:
    """``async``, ``sync`` or ``ssp:S`` (0 <= S <= 2^20); ValueError naming what is expected."""
    if text in ("async", "sync"):
        return Mode(text)
    m = re.fullmatch(r"ssp:(\d{1,7})", text)
    if m and int(m.group(1)) <= MAX_BOUND:
        return Mode("ssp", int(m.group(1)))
    raise ValueError(
        f"consistency must be async, sync or ssp:S (0 <= S <= {MAX_BOUND}), got {text!r}"
    )


class ModeConflict(Exception):
    """A replica declared another mode than the live run's."""


@dataclass
class _Replica:
    ticks: int = 0  #: 2 x the last step whose push was acknowledged (+1 once fetched after it)
    seen: float = 0.0  #: last report
    staleness: int = 0  #: at its last released fetch


@dataclass
class RunClocks:
    """The clocks of one run on one server. Mutated only through its methods, by one thread."""

    mode: Mode
    lease: float
    replicas: dict[str, _Replica] = field(default_factory=dict)
    max_staleness: int = 0  #: the largest staleness of any released fetch

    def live(self, now: float) -> dict[str, _Replica]:
        return {n: r for n, r in self.replicas.items() if now - r.seen <= self.lease}

    def declare(self, mode: Mode, now: float, expect: list[str] = ()) -> None:
        """A replica states the run's mode: refused (ModeConflict) if it differs from a live
        run's; a run with no live replica takes the new mode. ``expect``: names of the replicas
        the run starts with (each counts as live at clock 0 until its lease passes)."""
        if mode != self.mode:
            if self.live(now):
                raise ModeConflict(
                    f"the run is live in mode {self.mode}; this replica asks for {mode}"
                )
            self.mode = mode
            self.max_staleness = 0
        for name in expect:
            self.replicas.setdefault(name, _Replica(0, now))

    def join(self, replica: str, now: float) -> int:
        """A replica (re)starts: its clock in ticks. A known one keeps its clock; a new one
        starts at the slowest live clock's last pushed step."""
        r = self.replicas.get(replica)
        if r is None:
            live = self.live(now)
            start = min((x.ticks for x in live.values()), default=0) // 2 * 2
            r = self.replicas[replica] = _Replica(start, now)
        r.seen = now
        return r.ticks

    def report(self, replica: str, ticks: int, now: float) -> None:
        """The replica reached ``ticks`` (its pushes acknowledged, or its fetch done)."""
        r = self.replicas.setdefault(replica, _Replica(0, now))
        r.ticks = max(r.ticks, ticks)
        r.seen = now

    def blocking(self, replica: str, now: float) -> list[str]:
        """The live replicas that hold ``replica``'s next fetch back (empty: release it)."""
        r = self.replicas[replica]
        live = self.live(now).items()
        if self.mode.kind == "sync":
            return sorted(n for n, x in live if x.ticks < r.ticks)
        if self.mode.kind == "async":
            return []
        floor = r.ticks // 2 - self.mode.bound
        return sorted(n for n, x in live if x.ticks // 2 < floor)

    def release(self, replica: str, now: float) -> int:
        """Records the released fetch's staleness and returns it."""
        r = self.replicas[replica]
        slowest = min((x.ticks // 2 for x in self.live(now).values()), default=r.ticks // 2)
        r.staleness = max(0, r.ticks // 2 - slowest)
        self.max_staleness = max(self.max_staleness, r.staleness)
        return r.staleness
