"""The L-BFGS core against references (issue 14's correctness anchor, DistBelief 4.2): softmax
regression on the built-in MNIST, a convex problem, through the trainer's own model engine."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import scipy.optimize

from coordinator.lbfgs import (
    PARAM,
    Lbfgs,
    LbfgsConfig,
    LbfgsState,
    NumpyVectors,
    Regularized,
    wolfe_search,
)
from dataserver.sources import builtin_mnist
from trainer.model import Model

SOFTMAX = {
    "name": "softmax-mnist",
    "input": [28, 28, 1],
    "classes": 10,
    "layers": [{"type": "softmax", "name": "out", "units": 10}],
}
LAM = 1e-3


def make_problem(n: int | None = None):
    tx, ty, _, _ = builtin_mnist()
    tx, ty = tx[:n], ty[:n]
    model = Model(SOFTMAX, dtype=np.float64)
    x = model.prepare(tx)
    model.init_params(seed=3)
    x0 = model.params.copy()

    def fun(w: np.ndarray) -> tuple[float, np.ndarray]:
        model.params[...] = w
        f = model.loss_and_grad(x, ty)
        return f + 0.5 * LAM * float(w @ w), model.grads + LAM * w

    def fun_unreg(w: np.ndarray) -> tuple[float, np.ndarray]:
        model.params[...] = w
        f = model.loss_and_grad(x, ty)
        return f, model.grads.copy()

    return x0, fun, fun_unreg


@pytest.fixture(scope="module")
def problem():
    """All 4,000 training images."""
    return make_problem()


@pytest.fixture(scope="module")
def small():
    """The first 500 training images (the slower tests run many iterations)."""
    return make_problem(500)


def reference_lbfgs(fun, x0, m: int, iters: int, c1=1e-4, c2=0.9) -> list[float]:
    """A plain numpy L-BFGS: the textbook two-loop recursion with the same line search."""
    x = x0.copy()
    f, g = fun(x)
    losses = [f]
    S: list[np.ndarray] = []
    Y: list[np.ndarray] = []
    for _ in range(iters):
        q = g.copy()
        al = []
        for s, y in zip(reversed(S), reversed(Y), strict=True):
            a = (s @ q) / (s @ y)
            q -= a * y
            al.append(a)
        if S:
            q *= (S[-1] @ Y[-1]) / (Y[-1] @ Y[-1])
        for s, y, a in zip(S, Y, reversed(al), strict=True):
            b = (y @ q) / (s @ y)
            q += (a - b) * s
        d = -q
        alpha1 = 1.0 if S else min(1.0, 1.0 / math.sqrt(g @ g))
        search = wolfe_search(f, g @ d, alpha1, c1, c2, 20)
        a = next(search)
        try:
            while True:
                fa, ga = fun(x + a * d)
                a = search.send((fa, ga @ d))
        except StopIteration as stop:
            assert stop.value is not None
            a = stop.value
        xn = x + a * d
        fn, gn = fun(xn)
        S.append(xn - x)
        Y.append(gn - g)
        S, Y = S[-m:], Y[-m:]
        x, f, g = xn, fn, gn
        losses.append(f)
    return losses


def test_line_search_satisfies_strong_wolfe():
    # phi(a) = (a - 3)^2 from a = 0.1: the accepted step meets both conditions.
    phi = lambda a: ((a - 3.0) ** 2, 2 * (a - 3.0))  # noqa: E731
    f0, d0 = phi(0.0)
    s = wolfe_search(f0, d0, 0.1, 1e-4, 0.1, 30)
    a = next(s)
    try:
        while True:
            a = s.send(phi(a))
    except StopIteration as stop:
        a = stop.value
    fa, da = phi(a)
    assert fa <= f0 + 1e-4 * a * d0
    assert abs(da) <= 0.1 * abs(d0)


def test_anchor_matches_numpy_reference(problem):
    """The first 10 iterations' losses and the 30th's agree with the plain numpy two-loop."""
    x0, fun, _ = problem
    ref = reference_lbfgs(fun, x0, m=10, iters=30)
    opt = Lbfgs(NumpyVectors(x0, fun), LbfgsConfig(m=10, max_iter=30, gtol=0, ftol=0))
    st = opt.run()
    assert st.stopped == "max_iter"
    np.testing.assert_allclose(st.losses[:11], ref[:11], rtol=1e-10)
    np.testing.assert_allclose(st.losses[-1], ref[30], rtol=1e-7)
    assert st.losses[10] < 0.5 * st.losses[0]


def test_regularized_wrapper_is_the_same_objective(problem):
    """L2 through vector ops (as on the servers) = L2 inside the objective."""
    x0, fun, fun_unreg = problem
    cfg = LbfgsConfig(m=5, max_iter=8, gtol=0, ftol=0)
    a = Lbfgs(NumpyVectors(x0, fun), cfg).run()
    b = Lbfgs(Regularized(NumpyVectors(x0, fun_unreg), LAM), cfg).run()
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-9)


def test_final_loss_matches_scipy(small):
    """Run to convergence, the minimum matches scipy's L-BFGS-B (strictly convex problem)."""
    x0, fun, _ = small
    res = scipy.optimize.minimize(
        fun, x0, jac=True, method="L-BFGS-B",
        options={"maxcor": 10, "maxiter": 2000, "gtol": 1e-7, "ftol": 1e-15},
    )  # fmt: skip
    st = Lbfgs(NumpyVectors(x0, fun), LbfgsConfig(m=10, max_iter=2000, gtol=1e-7, ftol=1e-15)).run()
    assert st.stopped in ("gtol", "ftol")
    assert abs(st.f - res.fun) <= 1e-7 * abs(res.fun)


def test_float32_vectors_track_float64(problem):
    """The servers hold float32: the first 10 losses stay within float tolerance of float64."""
    x0, fun, _ = problem
    cfg = LbfgsConfig(m=10, max_iter=10, gtol=0, ftol=0)
    a = Lbfgs(NumpyVectors(x0, fun), cfg).run()
    b = Lbfgs(NumpyVectors(x0, fun, dtype=np.float32), cfg).run()
    np.testing.assert_allclose(a.losses, b.losses, rtol=1e-4)


class Crash(Exception):
    pass


class Crashing(NumpyVectors):
    """Raises after `budget` operations: a coordinator dying at an arbitrary point."""

    budget = 10**9

    def _tick(self) -> None:
        self.budget -= 1
        if self.budget < 0:
            raise Crash

    def dot(self, a, b):
        self._tick()
        return super().dot(a, b)

    def axpy(self, y, alpha, x):
        self._tick()
        super().axpy(y, alpha, x)

    def scale(self, y, alpha):
        self._tick()
        super().scale(y, alpha)

    def copy(self, dst, src):
        self._tick()
        super().copy(dst, src)

    def evaluate(self, grad, key):
        self._tick()
        return super().evaluate(grad, key)


@pytest.mark.parametrize("seed", range(4))
def test_restart_from_saved_state_gives_the_same_trajectory(small, seed):
    """A coordinator killed at random points and restarted from its last saved state (the
    vectors survive: they live on the servers) follows the uninterrupted trajectory exactly."""
    x0, fun, _ = small
    cfg = LbfgsConfig(m=4, max_iter=12, gtol=0, ftol=0)
    want = Lbfgs(NumpyVectors(x0, fun), cfg).run().losses
    rng = np.random.default_rng(seed)
    ops = Crashing(x0, fun)
    saved: list[str] = []
    state = None
    restarts = 0
    while True:
        ops.budget = int(rng.integers(5, 120))
        opt = Lbfgs(ops, cfg, state, on_state=lambda s: saved.append(json.dumps(s.to_dict())))
        try:
            st = opt.run()
            break
        except Crash:
            restarts += 1
            state = LbfgsState.from_dict(json.loads(saved[-1])) if saved else None
            if state is None:
                ops.v = {PARAM: np.array(x0)}  # died before x_0 was evaluated: start over
    assert restarts >= 3
    assert st.losses == want


class Servers(Crashing):
    """The vectors as a coordinator sees them on the cluster (coordinator/engine.py): an
    evaluation is the sum of portions pushed by trainers, each applied once (the servers'
    exactly-once table drops the copy a trainer pushes again), and an evaluation whose marker
    the record already holds is not zeroed again. The marker and the table live on the
    servers, so they survive the coordinator; a crash may come between any two pushes.

    Until its last portion is in, a trainer holding one may fetch ``param`` at any moment (a
    restarted coordinator hands the same portions out again under the same key, and the
    trainer keeps what it fetched for that key): every operation boundary where ``param`` is
    not the evaluation's point is recorded in ``torn``."""

    def __init__(self, x0, portion, n_portions: int) -> None:
        super().__init__(x0, fun=None)
        self.portion = portion
        self.n_portions = n_portions
        self.marker = None
        self.applied: set = set()
        self.loss = 0.0
        self.point: np.ndarray | None = None
        self.torn: list = []

    def _tick(self) -> None:
        key = self.marker and self.marker[0]
        open_ = key and any((key, p) not in self.applied for p in range(self.n_portions))
        if open_ and not np.array_equal(self.v[PARAM], self.point):
            self.torn.append(key)
        super()._tick()

    def evaluate(self, grad, key):
        if self.marker != (key, grad):
            self._tick()
            self._get(grad)[...] = 0.0
            self._tick()
            self.loss = 0.0
            self._tick()
            self.marker = (key, grad)
            self.point = self.v[PARAM].copy()
        for pid in range(self.n_portions):
            if (key, pid) in self.applied:
                continue
            self._tick()
            f, g = self.portion(self.point, pid)
            self._get(grad)[...] += g
            self.loss += f
            self.applied.add((key, pid))
        return self.loss


@pytest.fixture(scope="module")
def crashed_everywhere():
    """A regularized run on Servers, killed at each of its operations in turn and restarted from
    its last saved state: (crash points, those whose losses differ, those with a torn param)."""
    tx, ty, _, _ = builtin_mnist()
    n, n_portions = 500, 4
    model = Model(SOFTMAX, dtype=np.float64)
    x = model.prepare(tx[:n])
    model.init_params(seed=3)
    x0 = model.params.copy()

    def portion(w, pid):
        a, b = pid * n // n_portions, (pid + 1) * n // n_portions
        model.params[...] = w
        loss = model.loss_and_grad(x[a:b], ty[a:b], scale=(b - a) / n)
        return loss * (b - a) / n, model.grads.copy()

    cfg = LbfgsConfig(m=2, max_iter=4, gtol=0, ftol=0)
    clean = Servers(x0, portion, n_portions)
    want = Lbfgs(Regularized(clean, LAM), cfg).run().losses
    total = 10**9 - clean.budget
    assert total > 50 and clean.torn == []
    forked, torn = [], []
    for crash_at in range(total):
        ops = Servers(x0, portion, n_portions)
        ops.budget = crash_at
        saved: list[str] = []
        with pytest.raises(Crash):
            Lbfgs(
                Regularized(ops, LAM),
                cfg,
                None,
                lambda s, to=saved: to.append(json.dumps(s.to_dict())),
            ).run()
        ops.budget = 10**9
        state = LbfgsState.from_dict(json.loads(saved[-1])) if saved else None
        if state is None:
            ops.v[PARAM][...] = x0  # died before x_0 was evaluated: param is still x_0
        if Lbfgs(Regularized(ops, LAM), cfg, state).run().losses != want:
            forked.append(crash_at)
        if ops.torn:
            torn.append(crash_at)
    return total, forked, torn


def test_a_crash_at_any_operation_of_a_regularized_run_on_servers_changes_nothing(
    crashed_everywhere,
):
    """The coordinator killed at every single operation in turn (between two vector ops, two
    portions' pushes, or after the L2 term was added to a finished evaluation's gradient and
    before the state recording it was saved), then restarted from its record: the losses are
    those of the run without a crash, bit for bit. Reference: DistBelief 4.2 (Sandblaster's
    coordinator state); CI saw the trajectory fork after such a restart."""
    total, forked, _ = crashed_everywhere
    assert forked == [], f"{len(forked)} of {total} crash points fork the trajectory: {forked}"


def test_a_restarted_coordinator_never_shows_trainers_another_param(crashed_everywhere):
    """Killed during an evaluation, the coordinator replays its iteration and writes param
    again; a trainer fetching param meanwhile for a portion of that evaluation must see the
    evaluation's point, never x_k (param = x_k, then += alpha d, was a torn state)."""
    total, _, torn = crashed_everywhere
    assert torn == [], f"{len(torn)} of {total} crash points show a torn param: {torn}"
