"""A click-through workload nobody can tune to (issue 23): categorical examples drawn Zipf from
more than a million ids in several fields, labelled by a planted logistic model, so the best
achievable AUC is known.

An example has one id per field. Field f has ``sizes[f]`` ids (global ids ``offset[f] ..
offset[f] + sizes[f] - 1``), drawn with probability proportional to ``1 / (rank + 1) ** zipf``.
The planted truth gives every id a weight ``w(id) ~ N(0, sigma)`` (a function of (truth seed,
id), adamps.tables.initial_rows), and an example's label is 1 with probability
``sigmoid(bias + sum over fields of w(id_f))``. The Bayes-optimal scorer is that logit: its AUC
on a test set is the best any model can reach there (`best_auc`).

Pure numpy: examples are a function of (spec, seed, chunk index), so every replica and every run
draws the same data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from adamps.tables import initial_rows


@dataclass(frozen=True)
class CtrSpec:
    #: ids per field; the default totals 1,000,100
    sizes: tuple[int, ...] = (100, 10_000, 100_000, 890_000)
    zipf: float = 1.1
    #: standard deviation of the planted per-id weights
    sigma: float = 0.8
    bias: float = -1.0
    truth_seed: int = 20_261_124
    _offsets: tuple[int, ...] = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "_offsets", tuple(int(x) for x in np.cumsum((0, *self.sizes[:-1])))
        )

    @property
    def n_fields(self) -> int:
        return len(self.sizes)

    @property
    def n_ids(self) -> int:
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        return self._offsets


class CtrData:
    """Draws examples of a spec (the Zipf tables are built once)."""

    def __init__(self, spec: CtrSpec) -> None:
        self.spec = spec
        self._cdf = []
        for n in spec.sizes:
            p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** spec.zipf
            c = np.cumsum(p)
            self._cdf.append(c / c[-1])

    def true_weights(self, ids: np.ndarray) -> np.ndarray:
        init = {"kind": "normal", "mean": 0.0, "std": self.spec.sigma, "seed": self.spec.truth_seed}
        return initial_rows(init, ids.reshape(-1), 1).reshape(ids.shape)

    def examples(self, n: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(ids [n, fields] int64, labels [n] float32, true logits [n] float64) of draw `seed`."""
        rng = np.random.default_rng([self.spec.truth_seed, seed])
        cols = []
        for f, cdf in enumerate(self._cdf):
            rank = np.searchsorted(cdf, rng.random(n), side="right")
            cols.append(self.spec.offsets[f] + np.minimum(rank, len(cdf) - 1))
        ids = np.stack(cols, axis=1).astype(np.int64)
        logit = self.spec.bias + self.true_weights(ids).astype(np.float64).sum(axis=1)
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ids, labels, logit

    def dense_examples(
        self, n: int, seed: int, n_dense: int = 13
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(ids [n, fields] int64, dense [n, n_dense] float32, labels [n] float32, true logits)
        of draw `seed`: `examples`' ids, and integer counts as Criteo's dense features (each
        Poisson with a log-normal rate) whose ``log1p`` adds ``v_j * (log1p(x_j) - 1)`` to the
        planted logit, ``v_j ~ N(0, 0.5)`` fixed by the truth seed (the data servers' ``ctr``
        source, issue 38)."""
        ids, _, logit = self.examples(n, seed)
        rng = np.random.default_rng([self.spec.truth_seed, seed, 13])
        dense = rng.poisson(np.exp(rng.normal(1.0, 1.0, (n, n_dense)))).astype(np.float32)
        v = np.random.default_rng([self.spec.truth_seed, 13]).normal(0.0, 0.5, n_dense)
        logit = logit + (np.log1p(dense.astype(np.float64)) - 1.0) @ v
        labels = (rng.random(n) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
        return ids, dense, labels, logit


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half)."""
    labels = np.asarray(labels) > 0.5
    order = np.argsort(scores, kind="mergesort")
    s = np.asarray(scores)[order]
    ranks = np.empty(len(s), np.float64)
    # average ranks over ties
    _, start, counts = np.unique(s, return_index=True, return_counts=True)
    avg = start + (counts - 1) / 2.0 + 1.0
    ranks[order] = np.repeat(avg, counts)
    pos = int(labels.sum())
    neg = len(labels) - pos
    if pos == 0 or neg == 0:
        return float("nan")
    return float((ranks[labels].sum() - pos * (pos + 1) / 2.0) / (pos * neg))


def best_auc(data: CtrData, labels: np.ndarray, logits: np.ndarray) -> float:
    """The AUC of the planted truth's logits on these examples: the best achievable there."""
    return auc(labels, logits)
