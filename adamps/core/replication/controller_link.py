"""When a parameter server calls the controllers to register and to heartbeat (no IO, no clock).

A server is unknown to the controllers until it registers; once registered it heartbeats every
``interval`` (the controllers announce it at registration), and a heartbeat's answer carries its
roles and renewed leases. At most one of these calls is in flight at a time, so an answer is never
one of an earlier incarnation's. A heartbeat is sent early when the replication core wants the
record now (``want_record``: an epoch it does not know, a refused role change), but never while
another is in flight: it goes out when that one is answered.

When a call fails the server registers again as a fresh incarnation: at once when the controllers
declared it dead (``conflict`` or ``not_found``: a heartbeat cannot succeed again), else after
``retry`` seconds (the controllers unreachable: do not hammer them). Registering first makes the
replication core stop acting on every role (``ReplCore.unregistered``), so the positions it offers
are final.

The replication core holds the link (adamps.core.replication.controllers): its tick asks ``tick(now)``
which call to make and puts it in its ``Ready``; the answer the shell feeds back goes to
``on_registered``, ``on_heartbeat`` or ``on_failed``.
"""

from __future__ import annotations

#: what ``ControllerLink.tick`` asks the shell to send
REGISTER = "register"
HEARTBEAT = "heartbeat"


class ControllerLink:
    """One server's registration and heartbeats. Mutated only through its methods, by one shell."""

    def __init__(self, retry: float = 0.5, interval: float = 1.0) -> None:
        #: seconds before registering again after a failed call (the controllers unreachable)
        self.retry = retry
        #: seconds between heartbeats (replaced by what the controllers announce at registration)
        self.interval = interval
        #: "unregistered" | "registering" | "registered"
        self.state = "unregistered"
        #: when the next call is due: the registration (unregistered: at the first tick,
        #: whatever the clock reads) or the next heartbeat
        self._due = float("-inf")
        self._heartbeat_in_flight = False
        #: the replication core wants the record now: a heartbeat as soon as none is in flight
        self._wanted = False

    @property
    def registered(self) -> bool:
        return self.state == "registered"

    def tick(self, now: float) -> str | None:
        """The call to make now (REGISTER, HEARTBEAT) or None; it is in flight until answered."""
        if self.state == "unregistered" and now >= self._due:
            self.state = "registering"
            return REGISTER
        if self.state == "registered" and not self._heartbeat_in_flight:
            if self._wanted or now >= self._due:
                self._heartbeat_in_flight = True
                self._wanted = False
                return HEARTBEAT
        return None

    def next_due(self) -> float:
        """When ``tick`` next has a call to make: -inf (at once), a time, or inf (only after the
        call in flight is answered, an input of its own)."""
        if self.state == "unregistered":
            return self._due
        if self.state == "registered" and not self._heartbeat_in_flight:
            return float("-inf") if self._wanted else self._due
        return float("inf")

    def want_record(self) -> None:
        """Heartbeat now, or as soon as the one in flight is answered."""
        self._wanted = True

    def on_registered(self, interval: float | None, now: float) -> None:
        """The registration succeeded: the first heartbeat (which learns the roles) goes at once."""
        if self.state != "registering":
            return  # not the call in flight (cannot happen with one shell; ignored)
        self.state = "registered"
        if interval is not None:
            self.interval = float(interval)
        self._due = now
        self._heartbeat_in_flight = False

    def on_heartbeat(self, now: float) -> None:
        """The heartbeat in flight was answered: the next one is due `interval` from now."""
        if self.state == "registered" and self._heartbeat_in_flight:
            self._heartbeat_in_flight = False
            self._due = now + self.interval

    def on_failed(self, now: float, declared_dead: bool = False) -> None:
        """The call in flight failed: register again, at once if the controllers `declared_dead`
        this server (its heartbeats cannot succeed), else after `retry`. A record wanted is
        learnt by the new incarnation's first heartbeat."""
        self.state = "unregistered"
        self._heartbeat_in_flight = False
        self._wanted = False
        self._due = now if declared_dead else now + self.retry
