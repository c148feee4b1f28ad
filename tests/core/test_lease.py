"""Lease rules (Project Adam 3.3.3: the primary role is held via a lease from the controller)."""

from __future__ import annotations

import random

import pytest

from adamps.core.lease import (
    HolderLeases,
    Lease,
    LeaseError,
    LeaseTerms,
    check_history,
    expired,
    expires_at,
    grant,
    release,
    renew,
)

TERMS = LeaseTerms(duration=5.0, skew=0.1, margin=0.5)


def test_grant_renew_expiry() -> None:
    a = grant(None, "ps0", 100.0, TERMS)
    assert (a.holder, a.epoch, a.granted_at, a.renewed_at) == ("ps0", 1, 100.0, 100.0)
    assert expires_at(a, TERMS) == pytest.approx(100.0 + 5.0 * 1.1 + 0.5)
    a = renew(a, "ps0", 1, 103.0)
    assert not expired(a, 108.0, TERMS)
    assert not expired(a, 103.0 + 5.5 + 0.49, TERMS)
    assert expired(a, 103.0 + 5.5 + 0.5, TERMS)
    with pytest.raises(LeaseError, match="may still be in use"):
        grant(a, "ps1", 108.0, TERMS)
    b = grant(a, "ps1", 109.0, TERMS)
    assert (b.holder, b.epoch) == ("ps1", 2)
    # A renewal never moves a lease back in time (a leader with a slower clock).
    assert renew(b, "ps1", 2, 50.0).renewed_at == 109.0


def test_only_holder_at_its_epoch_renews_or_releases() -> None:
    a = grant(None, "ps0", 0.0, TERMS)
    for holder, epoch in (("ps1", 1), ("ps0", 2)):
        with pytest.raises(LeaseError):
            renew(a, holder, epoch, 1.0)
        with pytest.raises(LeaseError):
            release(a, holder, epoch, 1.0)
    r = release(a, "ps0", 1, 2.0)
    assert expired(r, 2.0, TERMS) and not expired(r, 1.9, TERMS)
    assert grant(r, "ps1", 2.0, TERMS).epoch == 2
    with pytest.raises(LeaseError, match="released"):
        renew(r, "ps0", 1, 3.0)


def test_terms_validation() -> None:
    for bad in ({"duration": 0}, {"skew": 1.0}, {"skew": -0.1}, {"margin": -1}):
        with pytest.raises(ValueError):
            LeaseTerms(**bad)


def test_holder_side_times_from_when_it_asked() -> None:
    h = HolderLeases(TERMS)
    assert not h.can_write(3, 1, 0.0)
    h.on_granted(3, 1, asked_at=10.0)
    deadline = 10.0 + 5.0 * 0.9
    assert h.can_write(3, 1, deadline - 1e-6)
    assert not h.can_write(3, 1, deadline)
    assert not h.can_write(3, 2, 11.0), "another epoch is not ours"
    # A late reply for an older epoch never resurrects it; an older ask never shortens.
    h.on_granted(3, 2, asked_at=20.0)
    h.on_granted(3, 1, asked_at=21.0)
    assert h.epoch(3) == 2
    h.on_granted(3, 2, asked_at=19.0)
    assert h.deadline(3) == pytest.approx(20.0 + 4.5)
    h.drop(3)
    assert not h.can_write(3, 2, 20.5)


def test_holder_always_stops_before_the_controller_regrants() -> None:
    """Reference: Project Adam 3.3.3. Whatever the message delays, with clock rates within the
    skew and controller wall clocks within margin/2 of real time, the holder's last write (real
    time) comes no later than the controller's next grant."""
    rng = random.Random(3)
    s, m, d = TERMS.skew, TERMS.margin, TERMS.duration
    for _ in range(5000):
        asked_real = rng.uniform(0, 100)
        commit_real = asked_real + rng.choice([0.0, rng.uniform(0, 3)])
        renewed_at = commit_real + rng.uniform(-m / 2, m / 2)  # leader's wall clock in the entry
        holder_rate = rng.choice([1 - s, 1 + s, rng.uniform(1 - s, 1 + s)])
        last_write_real = asked_real + d * (1 - s) / holder_rate
        # Another controller re-grants when ITS clock reads certain_expiry(renewed_at); its
        # clock has an offset within margin/2 and runs at a rate within the skew.
        offset = rng.uniform(-m / 2, m / 2)
        ctrl_rate = rng.choice([1 - s, 1 + s, rng.uniform(1 - s, 1 + s)])
        wait_ctrl = TERMS.certain_expiry(renewed_at) - (commit_real + offset)
        regrant_real = commit_real + max(0.0, wait_ctrl) / ctrl_rate
        assert last_write_real <= regrant_real + 1e-9


def test_check_history_finds_overlaps() -> None:
    a = grant(None, "ps0", 0.0, TERMS)
    a = renew(a, "ps0", 1, 4.0)
    ok = grant(a, "ps1", expires_at(a, TERMS), TERMS)
    records = [{"bucket": 0, **a.to_dict()}, {"bucket": 0, **ok.to_dict()}]
    assert check_history(records, TERMS) == []
    early = Lease("ps1", 2, 9.0, 9.0, 5.0)
    bad = [{"bucket": 0, **a.to_dict()}, {"bucket": 0, **early.to_dict()}]
    assert any("could be in use" in p for p in check_history(bad, TERMS))
    dup = [{"bucket": 1, **a.to_dict()}, {"bucket": 1, **a.to_dict()}]
    assert any("granted twice" in p for p in check_history(dup, TERMS))
