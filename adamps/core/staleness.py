"""Staleness-aware learning rates for asynchronous replicas (issue 36 item 5).

N Downpour replicas each fetch the servers' values, compute a gradient on them and push it; by
the time a push is applied, the other replicas' pushes have moved the values on: the gradient
is *stale* by tau updates. Each replica's server step is a full step, so N replicas in step
take N full steps from nearly the same point: the effective step is N times one replica's,
and with Adagrad's large first steps that is what costs async replicas their accuracy
(docs/training.md, "Several replicas").

Zhang et al. ("Staleness-aware Async-SGD", IJCAI 2016) divide each push's learning rate by its
staleness. Here tau is measured, not assumed: the shards' versions that each fetch returns
count the updates the servers applied; between two fetches of one replica those are its own
pushes plus tau from the others. The rule divides by ``1 + tau`` (the push's own update
counted), so that one replica (tau = 0) keeps its lr exactly (parity with torch.optim), and N
replicas in step (tau = N - 1) take 1/N steps: together, one replica's step per round.
Pure: no IO.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

#: the values of ``staleness=``: auto (the rule, the default: benchmarks/staleness.py,
#: docs/training.md "Several replicas"), off (every push at the group's lr)
MODES = ("auto", "off")


def staleness_lr(lr: float, tau: float) -> float:
    """The lr of a push whose gradient is `tau` updates behind the servers: ``lr / (1 + tau)``
    (tau below 0 counts as 0: a push is never scaled up)."""
    return lr / (1.0 + max(0.0, float(tau)))


def divides(spec: Mapping[str, object]) -> bool:
    """Whether "auto" divides the lr of a tensor under the servers' optimizer `spec`
    (adamps.optspec's dict): every optimizer but plain SGD (no momentum). Adagrad, Adam and
    RMSprop normalize each element's step, so their first steps are about lr per element
    whatever the gradient's size, and N replicas' first steps from one point add up N-fold:
    dividing gained 5-22 points at 4 replicas. Plain SGD's step is the gradient's, which moves
    little over N - 1 updates at a stable lr: dividing cost it 1 point at 4 replicas and gained
    nothing at 2 (benchmarks/staleness_sim.py, 3 seeds; docs/training.md). SGD with momentum
    keeps the division (unmeasured; asynchrony adds momentum of its own)."""
    return not (spec.get("kind") == "sgd" and not spec.get("momentum"))


def check_mode(mode: str) -> str:
    """`mode` if it is one of MODES, else ValueError naming what is expected."""
    if mode not in MODES:
        raise ValueError(f"staleness must be one of {list(MODES)}, got {mode!r}")
    return mode


class StalenessMeter:
    """The staleness of one worker's pushes, from the shard versions its fetches return (a
    version counts the updates applied to a shard). Owned by the thread that fetches."""

    def __init__(self, tau: float = 0.0) -> None:
        #: tensor -> its shards' versions at the last fetch
        self._last: dict[str, list[int]] = {}
        #: the updates others applied between this worker's last two fetches: the most any
        #: shard took, less this worker's own pushes (an integer: a few distinct lrs). Before
        #: two fetches measured it: `tau`, the guess (initial_tau: replicas in step)
        self.tau = float(tau)

    def fetched(self, versions: Mapping[str, Sequence[int]], own: int) -> float:
        """A fetch's shard versions (tensor -> per shard) and this worker's pushes since its
        previous fetch (`own`); returns the new tau. A shard whose version went down (a
        restored checkpoint) is not counted."""
        most, measured = 0, False
        for t, vs in versions.items():
            before = self._last.get(t)
            if before is not None and len(before) == len(vs):
                most = max([most] + [v - b for v, b in zip(vs, before, strict=True) if v >= b])
                measured = True
            self._last[t] = list(vs)
        if measured:
            self.tau = float(max(0, most - own))
        return self.tau


def initial_tau(world_size: int) -> float:
    """The staleness to assume before the first measurement: ``world_size - 1`` (``$WORLD_SIZE``
    of ``adamps launch`` or torchrun: that many replicas in step). The first pushes matter
    most: Adagrad's first step is about lr per element, and N replicas take it together from
    the same point (docs/training.md, "Several replicas")."""
    return float(max(0, world_size - 1))
