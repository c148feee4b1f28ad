"""The primary's pings, as the replication core decides them (no IO, no clock): every
``ping_interval`` a primary tells each replica of its buckets that it is alive under its epoch
(Project Adam 3.3.3: the primary heartbeats its secondaries), one message per replica for all its
buckets (``Ready.pings``). A secondary that hears no ping nor round for ``failover_after``
proposes a role change (``ReplCore.tick``); a ping of an older epoch is answered "stale", and
either side that learns of a newer epoch asks the controllers for the record. Part of ``ReplCore``
(adamps.core.replication.node), which holds the state these methods read; the shell sends the pings and
feeds the answers back (``on_ping_reply``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from adamps.core.replication.bucket import BucketReplica
from adamps.core.replication.ready import Ready
from adamps.core.replication.settings import ReplSettings


class Pings:
    """The ping methods of ``ReplCore``."""

    buckets: dict[int, BucketReplica]
    roles: dict[int, str]
    last_heard: dict[int, float]
    settings: ReplSettings
    _ready: Ready
    #: when the next pings are due (the first tick pings at once)
    _next_ping: float = 0.0

    def _pings_tick(self, now: float) -> None:
        if now >= self._next_ping:
            self._next_ping = now + self.settings.ping_interval
            self._ready.pings = self.pings()

    def _pings_due(self) -> float:
        """When the next pings are due (``_pings_tick``)."""
        return self._next_ping

    def pings(self) -> dict[str, dict[str, int]]:
        """Member -> {bucket: epoch} of the buckets this server is primary of: one ping each."""
        by_member: dict[str, dict[str, int]] = {}
        for b, role in self.roles.items():
            if role == "primary":
                rep = self.buckets[b]
                for m in rep.replicas:
                    by_member.setdefault(m, {})[str(b)] = rep.assignment.epoch
        return by_member

    def _on_ping(self, sender: str, pinged: Mapping[int, int], now: float) -> list[int]:
        """A primary's ping: its buckets' primaries are heard; the buckets this copy knows a
        newer epoch of are answered stale."""
        stale = []
        for b, epoch in pinged.items():
            rep = self.buckets.get(b)
            if rep is None:
                continue
            if rep.assignment.epoch == epoch and rep.assignment.primary == sender:
                self.last_heard[b] = now
            elif epoch < rep.assignment.epoch:
                stale.append(b)
            else:
                self._ready.heartbeat = True
        return stale

    def on_ping_reply(self, stale: Sequence[int], now: float) -> None:
        """A member says some of this server's pinged epochs are stale: ask the controllers."""
        if stale:
            self._ready.stale += len(stale)
            self._ready.heartbeat = True
