"""L-BFGS written against named vectors it never sees: DistBelief's Sandblaster (section 4.2).

The optimizer holds only scalars (the history's rho, s.y and y.y, the line search's trial
points); every vector lives behind :class:`VectorOps` under a name. On a cluster those names are
vectors stored beside each tensor's shards on the parameter servers and each call is one small
message per server (coordinator/psvectors.py); here, :class:`NumpyVectors` keeps them in memory.

Restartable by construction. :class:`LbfgsState` (plain JSON data) is handed to ``on_state``
after every completed evaluation and iteration. An iteration only reads vectors no step of the
same iteration writes (x and g alternate between two names by the parity of k, and the history
ring has m + 1 slots, so the slot an iteration fills is not one its two-loop reads), so a
restarted coordinator replays the current iteration from its start: the direction is recomputed
bit for bit, evaluations already recorded are fed to the line search from the state rather than
recomputed, and the first missing one is computed again. Each vector a step changes in place
is first overwritten by that step (copy, then axpy), so a step done twice gives the same bits;
the one sum built in place is an evaluation's gradient, whose parts a cluster applies exactly
once and does not zero again when a restarted coordinator repeats the evaluation (its key), so
nothing else may ever write into it (:class:`Regularized` adds its term into a copy).

Vectors: ``param`` (what the trainers evaluate), ``x0``/``x1`` and ``g0``/``g1`` (iterate and
gradient by parity; the next iterate's slot holds the line search's trial point), ``graw`` (the evaluation's gradient before the L2 term), ``d``
(direction), ``s<i>``/``y<i>`` for i < m + 1 (history ring).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

PARAM = "param"
#: the gradient of the objective without its L2 term (Regularized): what trainers push into
RAW = "graw"
#: f of the newest iterations kept in the state (it is written to the servers after each step)
MAX_LOSSES = 1000


class VectorOps(Protocol):
    """Operations on named vectors of one shape (the model's parameters). Writes name their
    destination first. ``evaluate`` computes the objective at ``param``, writes its gradient
    into ``grad`` and returns the objective; ``key`` names the evaluation (iteration, trial) so
    that a backend can recognize a repeat of it after a restart."""

    def dot(self, a: str, b: str) -> float: ...
    def axpy(self, y: str, alpha: float, x: str) -> None: ...  # y += alpha * x
    def scale(self, y: str, alpha: float) -> None: ...  # y *= alpha
    def copy(self, dst: str, src: str) -> None: ...  # dst = src
    def mul(self, y: str, x: str) -> None: ...  # y *= x (elementwise)
    def evaluate(self, grad: str, key: tuple[int, int]) -> float: ...


@dataclass(frozen=True)
class LbfgsConfig:
    #: history size
    m: int = 10
    #: sufficient decrease (Armijo) constant of the Wolfe conditions
    c1: float = 1e-4
    #: curvature constant of the strong Wolfe conditions
    c2: float = 0.9
    #: iterations at most
    max_iter: int = 50
    #: evaluations per line search at most
    max_evals: int = 20
    #: stop when ||g|| <= gtol
    gtol: float = 1e-5
    #: stop when the relative decrease of f is below ftol
    ftol: float = 1e-10


@dataclass
class LbfgsState:
    """Everything the optimizer knows besides the vectors: plain data, durable as JSON."""

    #: iteration; x_k is vector x{k%2}, its gradient g{k%2}
    k: int = 0
    #: f(x_k); None before the first evaluation
    f: float | None = None
    #: ||g_k||
    gnorm: float = math.inf
    #: history pairs, oldest first: {"slot", "rho", "sy", "yy"}
    hist: list[dict[str, Any]] = field(default_factory=list)
    #: evaluations of the current iteration's line search: [alpha, f, g.d]
    evals: list[list[float]] = field(default_factory=list)
    #: f of each finished iteration (f_0 first; the newest MAX_LOSSES)
    losses: list[float] = field(default_factory=list)
    #: why the run stopped, or None while it runs
    stopped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LbfgsState:
        return cls(**d)


# -- line search (pure: yields trial steps, receives (phi, dphi)) -----------------------------


def _cubic_min(
    a_lo: float, f_lo: float, d_lo: float, a_hi: float, f_hi: float, d_hi: float
) -> float:
    """The minimizer of the cubic through two points with derivatives, safeguarded into the
    middle 80% of the interval; bisection when it does not exist (Nocedal & Wright eq. 3.59)."""
    mid = 0.5 * (a_lo + a_hi)
    if a_lo == a_hi:
        return mid
    d1 = d_lo + d_hi - 3.0 * (f_lo - f_hi) / (a_lo - a_hi)
    disc = d1 * d1 - d_lo * d_hi
    if not math.isfinite(disc) or disc < 0:
        return mid
    d2 = math.copysign(math.sqrt(disc), a_hi - a_lo)
    den = d_hi - d_lo + 2.0 * d2
    if den == 0:
        return mid
    a = a_hi - (a_hi - a_lo) * (d_hi + d2 - d1) / den
    lo, hi = min(a_lo, a_hi), max(a_lo, a_hi)
    margin = 0.1 * (hi - lo)
    if not math.isfinite(a) or a < lo + margin or a > hi - margin:
        return mid
    return a


LineSearch = Generator[float, tuple[float, float], float | None]


def wolfe_search(
    f0: float, d0: float, alpha1: float, c1: float, c2: float, max_evals: int
) -> LineSearch:
    """Nocedal & Wright's algorithms 3.5 and 3.6 (bracketing, then zoom): yields trial steps
    and is sent (phi(alpha), phi'(alpha)) for each; returns a step satisfying the strong Wolfe
    conditions (always the last one tried) or None when max_evals ran out."""
    a_prev, f_prev, d_prev = 0.0, f0, d0
    a = alpha1
    evals = 0
    lo = hi = None
    while evals < max_evals:
        fa, da = yield a
        evals += 1
        if fa > f0 + c1 * a * d0 or (evals > 1 and fa >= f_prev):
            lo, hi = (a_prev, f_prev, d_prev), (a, fa, da)
            break
        if abs(da) <= -c2 * d0:
            return a
        if da >= 0:
            lo, hi = (a, fa, da), (a_prev, f_prev, d_prev)
            break
        a_prev, f_prev, d_prev = a, fa, da
        a = 2.0 * a
    if lo is None or hi is None:
        return None
    while evals < max_evals:
        a = _cubic_min(lo[0], lo[1], lo[2], hi[0], hi[1], hi[2])
        fa, da = yield a
        evals += 1
        if fa > f0 + c1 * a * d0 or fa >= lo[1]:
            hi = (a, fa, da)
        else:
            if abs(da) <= -c2 * d0:
                return a
            if da * (hi[0] - lo[0]) >= 0:
                hi = lo
            lo = (a, fa, da)
    return None


# -- the optimizer ---------------------------------------------------------------------------


class Lbfgs:
    """L-BFGS over ``ops``. Mutates only ``self.state`` (and the vectors, through ``ops``)."""

    def __init__(
        self,
        ops: VectorOps,
        cfg: LbfgsConfig,
        state: LbfgsState | None = None,
        on_state: Callable[[LbfgsState], None] | None = None,
    ) -> None:
        self.ops = ops
        self.cfg = cfg
        self.state = state if state is not None else LbfgsState()
        self.on_state = on_state or (lambda _s: None)

    def _save(self) -> None:
        self.on_state(self.state)

    def start(self) -> None:
        """Evaluates x_0 (the current ``param``) unless a restored state already did."""
        st = self.state
        if st.f is not None:
            return
        self.ops.copy("x0", PARAM)
        st.f = self.ops.evaluate("g0", (0, -1))
        st.gnorm = math.sqrt(self.ops.dot("g0", "g0"))
        st.losses = [st.f]
        self._save()

    def run(self) -> LbfgsState:
        self.start()
        while self.state.stopped is None:
            self.iterate()
        return self.state

    def _direction(self, gp: str) -> float:
        """d = -H g by the two-loop recursion; returns g.d (reset to steepest descent if >= 0)."""
        ops, hist = self.ops, self.state.hist
        ops.copy("d", gp)
        alphas = []
        for h in reversed(hist):
            a = h["rho"] * ops.dot(f"s{h['slot']}", "d")
            ops.axpy("d", -a, f"y{h['slot']}")
            alphas.append(a)
        if hist:
            ops.scale("d", hist[-1]["sy"] / hist[-1]["yy"])
        for h, a in zip(hist, reversed(alphas), strict=True):
            b = h["rho"] * ops.dot(f"y{h['slot']}", "d")
            ops.axpy("d", a - b, f"s{h['slot']}")
        ops.scale("d", -1.0)
        dg = ops.dot(gp, "d")
        if dg >= 0 or not math.isfinite(dg):
            # Not a descent direction (bad curvature pairs): forget them, steepest descent.
            self.state.hist = []
            ops.copy("d", gp)
            ops.scale("d", -1.0)
            dg = ops.dot(gp, "d")
        return dg

    def iterate(self) -> None:
        """One iteration: direction, line search, history update, convergence test."""
        st, ops, cfg = self.state, self.ops, self.cfg
        assert st.f is not None
        if st.k >= cfg.max_iter:
            st.stopped = "max_iter"
            self._save()
            return
        if st.gnorm <= cfg.gtol:
            st.stopped = "gtol"
            self._save()
            return
        p, n = st.k % 2, (st.k + 1) % 2
        xp, gp, xn, gn = f"x{p}", f"g{p}", f"x{n}", f"g{n}"
        d0 = self._direction(gp)
        alpha1 = 1.0 if st.hist else min(1.0, 1.0 / st.gnorm)
        search = wolfe_search(st.f, d0, alpha1, cfg.c1, cfg.c2, cfg.max_evals)
        # Evaluations a previous run of this iteration recorded are fed from the state; param
        # and gn still hold the newest of them (nothing writes them between evaluations).
        n_rec = len(st.evals)
        i = 0
        alpha = next(search)
        last: float | None = None
        accepted: float | None
        while True:
            if i < n_rec and st.evals[i][0] == alpha:
                _, f_a, d_a = st.evals[i]
                i += 1
                last = alpha if i == n_rec else None
            else:
                if i < n_rec:  # recorded for another direction: not ours, recompute from here
                    del st.evals[i:]
                    n_rec = i
                # The trial point is built in xn (free until the step is accepted) and param
                # is written whole by one copy: a restarted coordinator writes the same bits
                # over the evaluation it resumes, so trainers fetching param for its portions
                # meanwhile never see x_k, as they would between a copy and an axpy of param.
                ops.copy(xn, xp)
                ops.axpy(xn, alpha, "d")
                ops.copy(PARAM, xn)
                f_a = ops.evaluate(gn, (st.k, len(st.evals)))
                d_a = ops.dot(gn, "d")
                st.evals.append([alpha, f_a, d_a])
                i = n_rec = len(st.evals)
                last = alpha
                self._save()
            try:
                alpha = search.send((f_a, d_a))
            except StopIteration as done:
                accepted = done.value
                break
        if accepted is None:
            st.stopped = "line_search"
            self._save()
            return
        assert last == accepted  # the search accepts the step it tried last
        f_prev = st.f
        ops.copy(xn, PARAM)
        slot = st.k % (cfg.m + 1)
        s, y = f"s{slot}", f"y{slot}"
        ops.copy(s, PARAM)
        ops.axpy(s, -1.0, xp)
        ops.copy(y, gn)
        ops.axpy(y, -1.0, gp)
        sy, yy = ops.dot(s, y), ops.dot(y, y)
        hist = [h for h in st.hist if h["slot"] != slot]
        if sy > 1e-10 * yy and yy > 0:
            hist.append({"slot": slot, "rho": 1.0 / sy, "sy": sy, "yy": yy})
        st.hist = hist[-cfg.m :]
        st.f = st.evals[-1][1]
        st.gnorm = math.sqrt(ops.dot(gn, gn))
        st.k += 1
        st.evals = []
        st.losses.append(st.f)
        del st.losses[:-MAX_LOSSES]  # the record on the servers stays small
        if abs(f_prev - st.f) <= cfg.ftol * max(abs(f_prev), abs(st.f), 1.0):
            st.stopped = "ftol"
        self._save()


class NumpyVectors:
    """The in-memory backend: vectors in a dict, the objective a function of the parameters."""

    def __init__(
        self,
        x0: np.ndarray,
        fun: Callable[[np.ndarray], tuple[float, np.ndarray]],
        dtype: Any = np.float64,
    ) -> None:
        self.dtype = np.dtype(dtype)
        self.v: dict[str, np.ndarray] = {PARAM: np.array(x0, dtype=self.dtype)}
        self.fun = fun
        self.evaluations = 0

    def _get(self, name: str) -> np.ndarray:
        if name not in self.v:
            self.v[name] = np.zeros_like(self.v[PARAM])
        return self.v[name]

    def dot(self, a: str, b: str) -> float:
        return float(np.dot(self._get(a), self._get(b)))

    def axpy(self, y: str, alpha: float, x: str) -> None:
        yv = self._get(y)
        yv += self.dtype.type(alpha) * self._get(x)

    def scale(self, y: str, alpha: float) -> None:
        self._get(y)[...] *= self.dtype.type(alpha)

    def copy(self, dst: str, src: str) -> None:
        self._get(dst)[...] = self._get(src)

    def mul(self, y: str, x: str) -> None:
        self._get(y)[...] *= self._get(x)

    def evaluate(self, grad: str, key: tuple[int, int]) -> float:
        self.evaluations += 1
        f, g = self.fun(self.v[PARAM])
        self._get(grad)[...] = g
        return float(f)


class Regularized:
    """``ops`` with an L2 term lam/2 ||param||^2 added to the objective, computed with vector
    ops (so on a cluster it too stays on the servers). Makes softmax regression strictly convex:
    one minimum, which different optimizers can be compared at."""

    def __init__(self, ops: VectorOps, lam: float) -> None:
        self.inner = ops
        self.lam = lam

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def evaluate(self, grad: str, key: tuple[int, int]) -> float:
        if not self.lam:
            return self.inner.evaluate(grad, key)
        # The objective's own gradient goes to RAW, and grad is overwritten from it: a
        # coordinator restarted after the L2 term was added, before the state recording the
        # evaluation was saved, does it again from RAW. (Added to grad in place, it was added
        # twice: the restarted evaluation is not zeroed, its portions are dropped as duplicates.)
        f = self.inner.evaluate(RAW, key)
        f += 0.5 * self.lam * self.inner.dot(PARAM, PARAM)
        self.inner.copy(grad, RAW)
        self.inner.axpy(grad, self.lam, PARAM)
        return f
