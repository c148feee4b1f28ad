"""Server-side optimizers against a float64 numpy reference (DistBelief 4.1 for Adagrad)."""

from __future__ import annotations

import numpy as np
import pytest

from adamps.server.updates import optim
from adamps.server.updates.optim import Dense, Fc, OptimError, Optimizer, Scratch


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def f32(*shape: int, seed: int = 0) -> np.ndarray:
    return rng(seed).standard_normal(shape).astype(np.float32)


def test_sgd_dense_in_place_and_lr_minus_one_adds_exactly() -> None:
    w = np.zeros((64, 32), np.float32)
    before = w.__array_interface__["data"][0]
    d = np.full((64, 32), 0.25, np.float32)
    for _ in range(8):
        optim.sgd_dense(w, d, -1.0)
    assert w.__array_interface__["data"][0] == before
    assert np.array_equal(w, np.full((64, 32), 2.0, np.float32))


def test_sgd_dense_matches_reference_on_read_only_delta() -> None:
    w = f32(1000, seed=1)
    d = np.frombuffer(
        f32(1000, seed=2).tobytes(), np.float32
    )  # read-only, as decoded from the wire
    ref = w.copy()
    optim.reference_apply(Optimizer("sgd", 0.1), ref, None, d)
    optim.sgd_dense(w, d, 0.1)
    np.testing.assert_allclose(w, ref, rtol=1e-6, atol=1e-7)


def test_sgd_fc_writes_in_place_and_matches_numpy() -> None:
    w = f32(48, 40, seed=3)
    w0 = w.copy()
    a, e = f32(16, 40, seed=4), f32(16, 48, seed=5)
    optim.sgd_fc(w, a, e, 0.05)
    np.testing.assert_allclose(w, w0 - 0.05 * (e.T.astype(np.float64) @ a), rtol=1e-5, atol=1e-5)
    g = np.empty_like(w)
    assert np.shares_memory(optim.fc_grad(a, e, g), g)
    np.testing.assert_allclose(g, e.T.astype(np.float64) @ a, rtol=1e-5, atol=1e-5)


def test_in_place_check_refuses_a_silent_copy() -> None:
    w = np.zeros((8, 6), np.float32)[:, ::2]  # not contiguous: BLAS would work on a copy
    with pytest.raises(RuntimeError, match="in place"):
        optim.sgd_fc(w, f32(2, 3), f32(2, 8), 0.1)


def test_adagrad_matches_reference_over_steps() -> None:
    opt = Optimizer("adagrad_legacy", 0.1, {"eps": 1e-6, "initial_accumulator": 0.1})
    w, acc = f32(300, seed=6), np.full(300, 0.1, np.float32)
    w_ref, acc_ref = w.copy(), acc.copy()
    scratch = Scratch(1024)
    for step in range(5):
        g = f32(300, seed=10 + step)
        optim.apply_batch(opt, w, acc, [Dense(g)], scratch)
        optim.reference_apply(opt, w_ref, acc_ref, g)
    np.testing.assert_allclose(acc, acc_ref, rtol=1e-5)
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)


def test_adagrad_fc_is_adagrad_on_e_t_a() -> None:
    opt = Optimizer("adagrad_legacy", 0.05)
    w, acc = f32(20, 12, seed=7), np.zeros((20, 12), np.float32)
    w_ref, acc_ref = w.copy(), acc.copy()
    a, e = f32(4, 12, seed=8), f32(4, 20, seed=9)
    optim.apply_batch(opt, w, acc, [Fc(a, e)], Scratch(240))
    optim.reference_apply(opt, w_ref, acc_ref, e.T.astype(np.float64) @ a)
    # g itself is a float32 sgemm result: relative error ~1e-6, squared in acc.
    np.testing.assert_allclose(w, w_ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(acc, acc_ref, rtol=1e-4, atol=1e-9)


def test_batch_of_fc_pushes_is_one_stacked_update_equal_to_the_sum() -> None:
    opt = Optimizer("sgd", lr=0.01)
    w = f32(30, 25, seed=11)
    w0 = w.copy()
    pushes = [Fc(f32(k, 25, seed=20 + k), f32(k, 30, seed=40 + k)) for k in (1, 3, 16)]
    mixed = [pushes[0], Dense(f32(30, 25, seed=60)), pushes[1], pushes[2]]
    optim.apply_batch(opt, w, None, mixed, Scratch(750))
    total = sum(p.e.T.astype(np.float64) @ p.a for p in pushes) + f32(30, 25, seed=60)
    np.testing.assert_allclose(w, w0 - 0.01 * total, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adagrad_legacy", "adam", "rmsprop"])
def test_a_batch_is_deterministic(kind: str) -> None:
    """Replicas applying the same ordered batch end bit-identical."""
    opt = Optimizer(kind, lr=0.02)
    batch = [
        Dense(f32(10, 9, seed=1)),
        Fc(f32(5, 9, seed=2), f32(5, 10, seed=3)),
        Dense(f32(10, 9, seed=4)),
    ]
    results = []
    for _ in range(2):
        w = f32(10, 9, seed=5)
        acc = optim.initial_state(opt, 90) + 1 if opt.has_accumulator else None
        optim.apply_batch(opt, w, acc, batch, Scratch(90))
        results.append((w.tobytes(), None if acc is None else acc.tobytes()))
    assert results[0] == results[1]


@pytest.mark.parametrize(
    "bad",
    [
        {"kind": "adamax"},
        {"kind": "sgd", "lr": float("nan")},
        {"kind": "sgd", "lr": True},
        {"kind": "adagrad", "lr": -0.1},
        {"kind": "adagrad", "eps": 0},
        {"kind": "sgd", "momentum": 1.5},
        {"kind": "adagrad", "initial_accumulator": 0.1, "lr_decay": 0.1},
    ],
)
def test_bad_optimizer_descriptions_are_refused(bad: dict) -> None:
    with pytest.raises(OptimError):
        Optimizer.from_dict(bad)


def test_optimizer_round_trips() -> None:
    for opt in (
        Optimizer("sgd", -1),
        Optimizer("adagrad_legacy", 0.5, {"eps": 1e-4, "initial_accumulator": 0.1}),
    ):
        assert Optimizer.from_dict(opt.to_dict()) == opt
