"""Downpour's schedule (DistBelief 4.1, Project Adam 3.2.5), without threads or IO.

A replica trains in *rounds*: each of its ``workers`` trains ``n_push`` minibatches, then the
round's updates are pushed. It asks for the current parameters once every ``n_fetch``
minibatches per worker (not before replica 0's warm start is marked: until then its pulls would
only see the initial values). An epoch is complete once ``epoch_fraction`` of the replicas
finished it (the 75% rule); a replica still inside a complete epoch moves on to the next, and
skips epochs already complete when it starts. Within an epoch it reports its share of the
training images done (to the controllers only), and each finished epoch once.

``Schedule`` holds the counts these rules read and answers the replica's loops
(trainer/downpour.py), which carry its decisions out. Each field has one writer thread, named
in its comment, so the loops share it without locks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


def required_replicas(n_replicas: int, fraction: float) -> int:
    """How many replicas must finish an epoch for it to be complete (at least one)."""
    return max(1, min(n_replicas, math.ceil(fraction * n_replicas - 1e-9)))


def completed_epoch(finished: Mapping[Any, int], n_replicas: int, fraction: float) -> int:
    """The last complete epoch (0 = none): the largest e such that enough replicas have
    finished e or a later epoch. ``finished`` maps replica -> its last finished epoch."""
    last = sorted((int(v) for v in finished.values()), reverse=True)
    last += [0] * (n_replicas - len(last))
    return last[required_replicas(n_replicas, fraction) - 1]


@dataclass(frozen=True)
class Report:
    """What the board thread reports: this replica's progress in ``epoch`` (a fraction of its
    share of the images), ``done`` once every push of the epoch is acknowledged."""

    epoch: int
    progress: float
    done: bool


@dataclass
class Schedule:
    """The Downpour rules of one replica. The main thread calls ``start_epoch``,
    ``after_round``, ``want_fetch``, ``move_on``; the push thread ``epoch_finished``; the board
    thread ``observe`` and ``next_report``/``reported``."""

    workers: int  #: Hogwild workers of the replica
    n_push: int  #: minibatches per worker between two pushes (one round)
    n_fetch: int  #: minibatches per worker between two fetch requests
    warm_start: int  #: replica 0: minibatches it trains alone before the others join
    n_replicas: int
    epoch_fraction: float  #: share of the replicas that completes an epoch (0.75)
    replica: int = 0
    #: report progress inside an epoch (only the controllers' board keeps it)
    progress_reports: bool = False
    #: an elastic replica (trainer/elastic.py): it never leaves a leased slice half trained
    elastic: bool = False

    step: int = 0  #: replica steps (minibatches of all workers) so far (main thread)
    epoch: int = 0  #: the epoch being trained (main thread)
    since_fetch: int = 0  #: minibatches per worker since the last fetch request (main thread)
    warm_marked: bool = False  #: replica 0's warm start is (being) marked (main thread)
    completed: int = 0  #: last complete epoch seen on the board (board thread)
    last_finished: int = 0  #: last epoch this replica finished, pushes acknowledged (push thread)
    last_reported: int = 0  #: last finished epoch reported to the board (board thread)

    def __post_init__(self) -> None:
        # only replica 0 marks the warm start; the others wait for its mark before they start
        self.warm_marked = self.warm_marked or self.replica != 0

    @classmethod
    def of(cls, cfg: Any) -> Schedule:
        """The schedule of a TrainConfig."""
        return cls(
            workers=cfg.workers, n_push=cfg.n_push, n_fetch=cfg.n_fetch,
            warm_start=cfg.warm_start, n_replicas=cfg.n_replicas,
            epoch_fraction=cfg.epoch_fraction, replica=cfg.replica,
            progress_reports=bool(cfg.controllers), elastic=getattr(cfg, "elastic", False),
        )  # fmt: skip

    # -- the main thread

    @property
    def round_size(self) -> int:
        """Minibatches of one round: ``n_push`` per worker, then one push."""
        return self.workers * self.n_push

    def skip(self, epoch: int) -> bool:
        """Is ``epoch`` complete already (by the other replicas), so not to be trained?"""
        return epoch <= self.completed

    def start_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.since_fetch = 0

    def warm_due(self) -> bool:
        """Should replica 0 mark its warm start done now? (Once: the caller calls
        ``mark_warm``.)"""
        return not self.warm_marked and self.step >= self.warm_start

    def mark_warm(self) -> None:
        self.warm_marked = True

    def after_round(self, batches: int) -> None:
        """A round of ``batches`` minibatches was trained and its updates queued for a push.
        A short last round of an epoch still counts as ``n_push`` per worker towards a fetch."""
        self.step += batches
        self.since_fetch += self.n_push

    def want_fetch(self, pending: bool) -> bool:
        """Request a fetch now? True once ``n_fetch`` minibatches per worker passed since the
        last request, none is pending and the warm start is marked; the count restarts."""
        if pending or not self.warm_marked or self.since_fetch < self.n_fetch:
            return False
        self.since_fetch = 0
        return True

    def staleness(self, requested_at: int) -> int:
        """Replica steps between a fetch's request and its install."""
        return self.step - requested_at

    def move_on(self, epoch: int) -> bool:
        """Leave ``epoch`` now: enough replicas finished it (the 75% rule). An elastic replica
        finishes its slice: the data server applies the rule when it opens the next epoch."""
        return not self.elastic and self.completed >= epoch

    # -- the push thread

    def epoch_finished(self, epoch: int) -> None:
        """Every push of ``epoch`` is acknowledged (a marker in the push queue)."""
        self.last_finished = max(self.last_finished, epoch)

    # -- the board thread

    def observe(self, finished: Mapping[Any, int]) -> int:
        """The board's replica -> last finished epoch; returns the last complete epoch (it
        never goes back, even if the board briefly answers with fewer replicas)."""
        got = completed_epoch(finished, self.n_replicas, self.epoch_fraction)
        self.completed = max(self.completed, got)
        return self.completed

    def next_report(self, images: int, n_train: int | None) -> Report | None:
        """What to report now: the last finished epoch once, else (controllers only) the
        share of this epoch's images done, ``images`` of the ``n_train / n_replicas`` a
        replica trains. None: nothing to report."""
        finished = self.last_finished
        if finished > self.last_reported:
            return Report(finished, 1.0, True)
        if self.progress_reports and self.epoch > finished and n_train:
            share = n_train / self.n_replicas
            return Report(self.epoch, min(1.0, images / share), False)
        return None

    def reported(self, report: Report) -> None:
        """The board took ``report``."""
        if report.done:
            self.last_reported = max(self.last_reported, report.epoch)

    @property
    def all_reported(self) -> bool:
        """Has the board been told of every epoch this replica finished?"""
        return self.last_reported >= self.last_finished
