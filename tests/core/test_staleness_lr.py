"""The staleness-aware lr of async replicas (adamps/core/staleness.py; issue 36 item 5, after
Zhang et al., "Staleness-aware Async-SGD", IJCAI 2016): the rule and its measurement, pure."""

from __future__ import annotations

import pytest

from adamps.core.staleness import (
    StalenessMeter,
    check_mode,
    divides,
    initial_tau,
    staleness_lr,
)


def test_a_push_is_divided_by_one_plus_its_staleness() -> None:
    assert staleness_lr(0.02, 0) == 0.02  # one replica: torch.optim's lr, exactly
    assert staleness_lr(0.02, 1) == 0.01  # two in step: each takes half a step
    assert staleness_lr(0.02, 3) == 0.005  # four: a quarter
    assert staleness_lr(0.02, -2) == 0.02  # never scaled up


def test_one_worker_alone_measures_no_staleness() -> None:
    m = StalenessMeter()
    versions = {"w": [0, 0], "b": [0]}
    for _ in range(5):  # each fetch follows one own push of every tensor
        versions = {t: [v + 1 for v in vs] for t, vs in versions.items()}
        assert m.fetched(versions, own=1) == 0.0


def test_the_others_updates_between_two_fetches_are_the_staleness() -> None:
    m = StalenessMeter()
    assert m.fetched({"w": [10, 10]}, own=0) == 0.0  # the first fetch: nothing to compare
    # own push + 3 by other replicas on one shard, 2 on the other: the most any shard took
    assert m.fetched({"w": [14, 13]}, own=1) == 3.0
    # a tensor this worker did not push (no gradient) still counts the others' updates
    assert m.fetched({"w": [16, 15], "x": [0]}, own=1) == 1.0


def test_a_version_that_went_down_is_not_counted() -> None:
    m = StalenessMeter()
    m.fetched({"w": [50]}, own=0)
    assert m.fetched({"w": [7]}, own=1) == 0.0  # a checkpoint restored under the replica
    assert m.fetched({"w": [9]}, own=1) == 1.0


def test_the_mode_is_checked() -> None:
    assert check_mode("auto") == "auto" and check_mode("off") == "off"
    with pytest.raises(ValueError, match=r"staleness must be one of \['auto', 'off'\], got 'on'"):
        check_mode("on")


def test_before_two_fetches_the_replicas_in_step_are_assumed() -> None:
    # $WORLD_SIZE replicas start together: their first pushes are that stale
    assert initial_tau(1) == 0.0 and initial_tau(4) == 3.0 and initial_tau(0) == 0.0
    m = StalenessMeter(initial_tau(4))
    assert m.fetched({"w": [0]}, own=0) == 3.0  # nothing to compare yet: the guess stands
    assert m.fetched({"w": [3]}, own=1) == 2.0  # measured: 2 by the others


def test_auto_divides_every_optimizer_but_plain_sgd() -> None:
    from adamps.optspec import spec_of

    assert not divides(spec_of("sgd", 0.1, 0.0, None))  # its step is the gradient's
    assert divides(spec_of("sgd", 0.1, 0.0, {"momentum": 0.9}))  # unmeasured: kept
    for kind in ("adagrad", "adam", "adamw", "rmsprop", "adagrad_legacy"):
        assert divides(spec_of(kind, 0.1, 0.1, None)), kind
