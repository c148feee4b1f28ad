"""The exactness checker itself (adamps/testing/exactness.py), without processes.

A checker that cannot fail proves nothing: each rule of issue 11's contract is shown to reject the
values that break it, and loss windows to excuse only what they cover.
"""

from __future__ import annotations

import numpy as np
import pytest

from adamps.layout import Layout, TensorSpec
from adamps.testing.exactness import ExactnessLoad


class _NoClient:
    retry_for = 0.0


def load_with(acked: list[tuple[float, int]], failed=(), unknown=()) -> ExactnessLoad:
    spec = TensorSpec("x", (100,))
    layout = Layout([spec], n_buckets=4, max_shard_elems=10)
    load = ExactnessLoad(_NoClient(), layout, "x")  # type: ignore[arg-type]
    load.out.ack_times = list(acked)
    load.out.acked = [e for _, e in acked]
    load.out.failed = list(failed)
    load.out.unknown = list(unknown)
    return load


def values(ones=(), twos=()) -> np.ndarray:
    v = np.zeros(100, np.float32)
    v[list(ones)] = 1.0
    v[list(twos)] = 2.0
    return v


def test_every_acknowledged_push_must_be_present_exactly_once() -> None:
    load = load_with([(1.0, 3), (2.0, 4)])
    assert load.check(values(ones=[3, 4]))["acked"] == 2
    with pytest.raises(AssertionError, match="1 of 2 acknowledged pushes not present"):
        load.check(values(ones=[3]))
    with pytest.raises(AssertionError, match="not present exactly once"):
        load.check(values(ones=[3], twos=[4]))


def test_failed_absent_unknown_at_most_once_and_no_strays() -> None:
    load = load_with([], failed=[5], unknown=[6, 7])
    load.check(values(ones=[6]))
    with pytest.raises(AssertionError, match="failed pushes applied"):
        load.check(values(ones=[5]))
    with pytest.raises(AssertionError, match="unknown pushes applied more than once"):
        load.check(values(twos=[7]))
    with pytest.raises(AssertionError, match="nobody pushed"):
        load.check(values(ones=[9]))


def test_a_loss_window_excuses_missing_acks_inside_it_only_and_never_doubles() -> None:
    load = load_with([(1.0, 1), (5.0, 2), (9.0, 3)])
    counts = load.check(values(ones=[1, 3]), lossy=[(4.0, 6.0)])
    assert counts["acked_in_loss_windows"] == 1 and counts["lost_in_loss_windows"] == 1
    with pytest.raises(AssertionError, match="1 of 2 acknowledged"):
        load.check(values(ones=[3, 2]), lossy=[(4.0, 6.0)])  # element 1, before the window
    with pytest.raises(AssertionError, match="inside a loss window applied more than once"):
        load.check(values(ones=[1, 3], twos=[2]), lossy=[(4.0, 6.0)])


def test_a_read_during_load_excuses_acks_after_it_was_sent() -> None:
    load = load_with([(1.0, 1), (5.0, 2)])
    assert load.problems(values(ones=[1]), read_at=3.0) == []
    assert load.problems(values(ones=[1, 2, 7]), read_at=3.0) == []  # 7 may be in flight
    assert load.problems(values(ones=[2]), read_at=3.0) != []
