"""Downpour's schedule without threads or sockets: rounds of ``n_push`` minibatches per worker,
a fetch every ``n_fetch`` (DistBelief 4.1), replica 0's warm start, and the epoch-end rule
(Project Adam 3.2.5: an epoch is complete once 75% of the replicas finished it; the others move
on), and what the board is told."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from trainer.schedule import Report, Schedule


def schedule(**kw: object) -> Schedule:
    args: dict[str, object] = {
        "workers": 1, "n_push": 1, "n_fetch": 1, "warm_start": 0, "n_replicas": 1,
        "epoch_fraction": 0.75, "replica": 1,
    }  # fmt: skip
    args.update(kw)
    return Schedule(**args)  # type: ignore[arg-type]


def rounds_that_fetch(s: Schedule, rounds: int, pending_for: int = 0) -> list[int]:
    """Drives the main loop's calls for ``rounds`` full rounds; a requested fetch stays pending
    for ``pending_for`` rounds. Returns the rounds (1-based) in which a fetch was requested."""
    out, pending_until = [], 0
    for r in range(1, rounds + 1):
        s.after_round(s.round_size)
        if s.want_fetch(r < pending_until):
            out.append(r)
            pending_until = r + 1 + pending_for
    return out


def test_a_round_is_n_push_minibatches_per_worker() -> None:
    s = schedule(workers=3, n_push=4)
    assert s.round_size == 12
    s.after_round(12)
    s.after_round(5)  # a short last round
    assert s.step == 17


def test_a_fetch_every_n_fetch_minibatches_per_worker() -> None:
    # n_push 2, n_fetch 5: due after 6 minibatches per worker, i.e. every third round
    assert rounds_that_fetch(schedule(workers=3, n_push=2, n_fetch=5), 9) == [3, 6, 9]
    assert rounds_that_fetch(schedule(n_push=1, n_fetch=1), 4) == [1, 2, 3, 4]
    # n_fetch below n_push: every round, not more often
    assert rounds_that_fetch(schedule(n_push=8, n_fetch=2), 3) == [1, 2, 3]


@given(st.integers(1, 20), st.integers(1, 60), st.integers(1, 50), st.integers(1, 4))
def test_fetch_count_follows_n_fetch(n_push: int, n_fetch: int, rounds: int, workers: int) -> None:
    s = schedule(workers=workers, n_push=n_push, n_fetch=n_fetch)
    assert len(rounds_that_fetch(s, rounds)) == rounds // math.ceil(n_fetch / n_push)


def test_no_second_fetch_while_one_is_pending() -> None:
    s = schedule(n_push=1, n_fetch=2)
    # requested in round 2; pending through round 4; due again at once when it arrived
    assert rounds_that_fetch(s, 8, pending_for=2) == [2, 5, 8]


def test_the_fetch_count_restarts_with_each_epoch() -> None:
    s = schedule(n_push=1, n_fetch=3)
    s.start_epoch(1)
    s.after_round(1)
    s.after_round(1)
    s.start_epoch(2)
    s.after_round(1)
    assert not s.want_fetch(False)
    s.after_round(1)
    s.after_round(1)
    assert s.want_fetch(False)


def test_replica_0_marks_its_warm_start_once_and_fetches_only_after_it() -> None:
    s = schedule(replica=0, n_push=2, n_fetch=2, warm_start=5)
    assert not s.warm_marked and not s.warm_due()
    s.after_round(2)
    s.after_round(2)
    assert not s.warm_due() and not s.want_fetch(False)  # 4 steps < 5: no fetch either
    s.after_round(2)
    assert s.warm_due()
    s.mark_warm()
    assert not s.warm_due()
    assert s.want_fetch(False)
    assert schedule(replica=0, warm_start=0).warm_due()  # no warm start: marked at once


def test_the_other_replicas_never_mark_a_warm_start() -> None:
    s = schedule(replica=2, warm_start=0)
    assert s.warm_marked and not s.warm_due()
    assert s.want_fetch(False) is False  # nothing trained yet
    s.after_round(1)
    assert s.want_fetch(False)


def test_an_epoch_is_complete_once_75_percent_of_the_replicas_finished_it() -> None:
    s = schedule(n_replicas=4, epoch_fraction=0.75)
    s.start_epoch(1)
    assert s.observe({"0": 1, "1": 1}) == 0
    assert not s.move_on(1)
    assert s.observe({"0": 2, "1": 1, "2": 1}) == 1  # three of four finished epoch 1
    assert s.move_on(1) and not s.move_on(2)
    assert s.skip(1) and not s.skip(2)


def test_the_complete_epoch_never_goes_back() -> None:
    s = schedule(n_replicas=2, epoch_fraction=0.5)
    assert s.observe({"0": 3}) == 3
    assert s.observe({}) == 3  # a board that briefly answers with nothing
    assert s.completed == 3


def test_a_finished_epoch_is_reported_once() -> None:
    s = schedule(n_replicas=2)
    s.start_epoch(2)
    assert s.next_report(0, 1000) is None  # static board: no progress reports
    s.epoch_finished(1)
    assert not s.all_reported
    r = s.next_report(0, 1000)
    assert r == Report(1, 1.0, True)
    assert s.next_report(0, 1000) == r  # until the board took it
    s.reported(r)
    assert s.all_reported and s.next_report(0, 1000) is None
    s.epoch_finished(1)  # a late marker of an older epoch changes nothing
    assert s.last_finished == 1 and s.all_reported


def test_progress_inside_an_epoch_goes_to_the_controllers_only() -> None:
    s = schedule(n_replicas=4, progress_reports=True)
    s.start_epoch(1)
    # a replica trains n_train / n_replicas images of an epoch: 250 of 1000
    assert s.next_report(100, 1000) == Report(1, 0.4, False)
    assert s.next_report(400, 1000) == Report(1, 1.0, False)  # capped
    assert s.next_report(100, None) is None  # the size of the training set is unknown
    s.reported(Report(1, 0.4, False))
    assert s.last_reported == 0  # progress is no finished epoch
    s.epoch_finished(1)
    assert s.next_report(250, 1000) == Report(1, 1.0, True)


def test_two_replicas_the_slow_one_moves_on() -> None:
    """Two schedules sharing one board (a dict): with epoch_fraction 0.5 the fast replica's
    finished epoch completes it, and the slow one leaves it and skips what is complete."""
    board: dict[str, int] = {}
    fast = schedule(replica=0, n_replicas=2, epoch_fraction=0.5, warm_start=0)
    slow = schedule(replica=1, n_replicas=2, epoch_fraction=0.5)
    fast.mark_warm()
    for epoch in (1, 2):
        fast.start_epoch(epoch)
        fast.after_round(1)
        fast.epoch_finished(epoch)
        r = fast.next_report(0, None)
        assert r is not None and r.done
        board["0"] = r.epoch
        fast.reported(r)
    slow.start_epoch(1)
    slow.after_round(1)
    slow.observe(board)
    assert slow.move_on(1)
    assert slow.skip(2) and not slow.skip(3)
    assert slow.next_report(0, None) is None  # moved on: epoch 1 is not reported as finished


def test_replica_0_evaluates_every_epoch_completed_between_two_looks() -> None:
    """The board can report epochs 1 and 2 complete at once (replica 0 was in its last rounds,
    or the machine was loaded): --history still gets one line per complete epoch, in order,
    and a restarted replica 0 does not evaluate again the epochs complete before it started."""
    from types import SimpleNamespace

    from trainer.downpour import Replica

    def fake(completed: int, upto: int) -> SimpleNamespace:
        r = SimpleNamespace(
            completed=completed, cfg=SimpleNamespace(epochs=3), _evaluated_upto=upto,
            result=SimpleNamespace(accuracy={}), evaluated=[],
        )  # fmt: skip

        def evaluate(epoch: int, x: object, y: object) -> None:
            r.evaluated.append(epoch)
            r.result.accuracy[epoch] = 0.5

        r._evaluate = evaluate
        return r

    r = fake(completed=2, upto=0)
    Replica._evaluate_completed(r, "x", "y")
    assert r.evaluated == [1, 2]
    Replica._evaluate_completed(r, "x", "y")
    assert r.evaluated == [1, 2]
    r.completed = 5  # past --epochs: evaluates up to the last epoch only
    Replica._evaluate_completed(r, "x", "y")
    assert r.evaluated == [1, 2, 3]
    restarted = fake(completed=2, upto=1)
    Replica._evaluate_completed(restarted, "x", "y")
    assert restarted.evaluated == [2]
    no_heldout = fake(completed=2, upto=0)
    Replica._evaluate_completed(no_heldout, None, None)
    assert no_heldout.evaluated == []
