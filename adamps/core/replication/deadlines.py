"""When a primary's message to a replica has gone unanswered too long (issue 40: peer timeouts
are ticks of the core; the transport only reports what happened).

A replica has ``member_timeout`` to answer a message, beyond the time the message's bytes take
at ``rate_floor``, a rate any live peer takes at least (a 21 MB batch of a 64 MiB push is no
sign of a dead peer if it takes 0.6 s). The messages to one peer share its link (the transport
sends them in order over one channel), so a message's bytes start once those sent to the same
peer before it have gone: a COMMIT queued behind another bucket's large PREPARE gets that
PREPARE's time too. ``PeerLinks`` keeps, per peer, when the bytes sent to it so far are through
at the floor rate; a message's deadline is that plus ``member_timeout`` (``Outstanding``).

The core's tick fails a message past its deadline (``Rounds.overdue``) as it fails one the
transport reports failed: retried after ``RETRY_EVERY``, its replica unresponsive
(``Rounds.failed``); its id is forgotten, so a reply that comes later changes nothing. The
core's ``next_deadline`` includes these deadlines (``Rounds.due``): an idle bucket with an
unanswered PREPARE is ticked at its deadline. The transport's own timeout is a safety net only
(it frees a socket; adamps/server/replication/peers.py): ``SAFETY`` member timeouts from when
its request starts, plus the request's bytes at the floor rate on the data plane (over HTTP,
without them: a batch beyond (SAFETY - 1) member timeouts at the floor rate may fail there
first, as before issue 40).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adamps.core.replication.values import payload_bytes

__all__ = ["PeerLinks", "payload_bytes"]


class PeerLinks:
    """Per peer, when the bytes of the messages sent to it so far are through at the floor rate.
    Mutated only by ReplCore."""

    def __init__(self, timeout: float, rate: float) -> None:
        #: seconds a replica has to answer beyond its message's bytes (member_timeout)
        self.timeout = timeout
        #: bytes per second a live peer takes at least (rate_floor)
        self.rate = rate
        #: peer -> when the bytes sent to it so far are through at the floor rate
        self.through: dict[str, float] = {}

    def deadline(self, peer: str, fields: Mapping[str, Any], now: float) -> float:
        """The deadline of a message with `fields` sent to `peer` now."""
        entries = fields.get("entries")
        start = self.through.get(peer, now)
        start = start if start > now else now
        done = self.through[peer] = start + (payload_bytes(entries) if entries else 0) / self.rate
        return done + self.timeout
