"""adamps.core.replication.controller_link without sockets or clock: when a server registers with the
controllers, heartbeats them, and registers again after a failure (time passed in)."""

from __future__ import annotations

from adamps.core.replication.controller_link import HEARTBEAT, REGISTER, ControllerLink


def registered(now: float = 0.0, interval: float = 1.0) -> ControllerLink:
    link = ControllerLink(retry=0.5)
    assert link.tick(now) == REGISTER
    link.on_registered(interval, now)
    return link


def test_registers_first_and_heartbeats_at_once_then_every_interval() -> None:
    link = ControllerLink(retry=0.5)
    assert not link.registered
    assert link.tick(0.0) == REGISTER
    assert link.tick(0.1) is None, "one call in flight at a time"
    link.on_registered(2.0, 0.2)
    assert link.registered and link.interval == 2.0, "the interval the controllers announce"
    assert link.tick(0.2) == HEARTBEAT, "the first heartbeat learns the roles at once"
    assert link.tick(5.0) is None, "not while one is in flight, however late"
    link.on_heartbeat(0.3)
    assert link.tick(2.2) is None
    assert link.tick(2.3) == HEARTBEAT


def test_a_wanted_record_heartbeats_early_but_never_two_at_once() -> None:
    link = registered()
    assert link.tick(0.0) == HEARTBEAT
    link.want_record()
    assert link.tick(0.1) is None, "the heartbeat in flight is answered first"
    link.on_heartbeat(0.2)
    assert link.tick(0.2) == HEARTBEAT, "then the wanted one goes at once"
    link.on_heartbeat(0.3)
    assert link.tick(0.4) is None, "wanted once, sent once"
    link.want_record()
    assert link.tick(0.5) == HEARTBEAT


def test_a_failure_registers_again_after_retry_or_at_once_when_declared_dead() -> None:
    link = registered()
    assert link.tick(0.0) == HEARTBEAT
    link.on_failed(1.0)  # the controllers unreachable
    assert not link.registered
    assert link.tick(1.4) is None, "back off: do not hammer unreachable controllers"
    assert link.tick(1.5) == REGISTER
    link.on_failed(1.6)  # the registration failed too
    assert link.tick(2.0) is None and link.tick(2.1) == REGISTER
    link.on_registered(None, 2.2)
    assert link.interval == 1.0, "kept when the answer names none"
    assert link.tick(2.2) == HEARTBEAT
    link.on_failed(2.3, declared_dead=True)  # conflict / not_found: heartbeats cannot succeed
    assert link.tick(2.3) == REGISTER, "a new incarnation at once"


def test_a_record_wanted_while_unregistered_is_learnt_by_the_first_heartbeat() -> None:
    link = ControllerLink(retry=0.5)
    link.want_record()
    assert link.tick(0.0) == REGISTER, "registration comes first"
    link.on_registered(1.0, 0.1)
    assert link.tick(0.1) == HEARTBEAT
    link.on_heartbeat(0.2)
    assert link.tick(0.3) is None, "the first heartbeat was the one wanted"


def test_stray_answers_change_nothing() -> None:
    link = ControllerLink(retry=0.5)
    link.on_heartbeat(0.0)
    link.on_registered(1.0, 0.0)
    assert not link.registered, "no registration was in flight"
    link = registered()
    link.on_heartbeat(0.0)  # no heartbeat in flight: the schedule stays
    assert link.tick(0.0) == HEARTBEAT
