"""The declarative model, its flat parameter buffer, whole-model gradients, and a short real
training run on the built-in MNIST sample (Project Adam 4.3.3's model)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from trainer.local import epoch_batches, train_local
from trainer.model import Model, builtin, resolve_spec, tensor_layout

SMALL = {
    "name": "small",
    "input": [9, 9, 2],
    "classes": 3,
    "layers": [
        {"type": "conv", "name": "conv1", "size": 3, "filters": 3, "activation": "tanh"},
        {"type": "pool", "name": "pool1", "size": 2},
        {"type": "conv", "name": "conv2", "size": 2, "filters": 4, "activation": "relu"},
        {"type": "fc", "name": "fc1", "units": 6, "activation": "sigmoid"},
        {"type": "softmax", "name": "out", "units": 3},
    ],
}


def test_adam_mnist_layout_and_connections() -> None:
    model = Model("adam-mnist")
    assert model.connections() == 756_000
    assert model.n_params == 298_090
    assert model.tensors() == [
        ("conv1.w", (10, 5, 5, 1)),
        ("conv1.b", (10,)),
        ("conv2.w", (20, 5, 5, 10)),
        ("conv2.b", (20,)),
        ("fc1.w", (400, 320)),
        ("fc1.b", (400,)),
        ("fc2.w", (400, 400)),
        ("fc2.b", (400,)),
        ("out.w", (10, 400)),
        ("out.b", (10,)),
    ]
    assert tensor_layout("adam-mnist") == model.tensors()


def test_description_round_trips_through_json() -> None:
    model = Model(builtin("adam-mnist"))
    again = Model(json.dumps(model.to_dict()))
    assert again.tensors() == model.tensors()
    assert again.connections() == model.connections()


@pytest.mark.parametrize(
    "spec",
    [
        {"input": [8, 8, 1], "layers": []},
        {"input": [8, 8], "layers": [{"type": "softmax", "name": "o", "units": 2}]},
        {"input": [8, 8, 1], "layers": [{"type": "fc", "name": "o", "units": 2}]},
        {
            "input": [8, 8, 1],
            "layers": [
                {"type": "fc", "name": "a", "units": 2},
                {"type": "softmax", "name": "a", "units": 2},
            ],
        },
        {
            "input": [8, 8, 1],
            "classes": 5,
            "layers": [{"type": "softmax", "name": "o", "units": 2}],
        },
    ],
)
def test_bad_descriptions_are_rejected(spec: dict) -> None:
    with pytest.raises(ValueError):
        Model(spec)


def test_export_round_trips_through_npz(tmp_path) -> None:
    model = Model(SMALL)
    model.init_params(7)
    path = tmp_path / "weights.npz"
    np.savez(path, **model.export())
    with np.load(path) as arrays:
        again = Model.from_export(arrays)
    assert again.to_dict() == model.to_dict()
    np.testing.assert_array_equal(again.params, model.params)
    bad = model.export()
    bad["fc1.w"] = bad["fc1.w"][:2]
    with pytest.raises(ValueError, match="fc1.w"):
        Model.from_export(bad)


def test_unknown_builtin_and_wrong_buffer_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown model"):
        resolve_spec("no-such-model")
    with pytest.raises(ValueError, match="flat"):
        Model("adam-mnist", params=np.zeros(10, np.float32))
    with pytest.raises(ValueError, match="flat"):
        Model("adam-mnist", params=np.zeros(298_090, np.float64))


def test_tensors_are_views_of_one_flat_buffer() -> None:
    buf = np.zeros(Model(SMALL).n_params, np.float32)
    a, b = Model(SMALL, params=buf), Model(SMALL, params=buf)
    a.init_params(3)
    assert np.shares_memory(a.param("fc1.w"), buf)
    np.testing.assert_array_equal(b.param("conv2.w"), a.param("conv2.w"))
    for name, sl in a.slices().items():
        np.testing.assert_array_equal(buf[sl].reshape(a.param(name).shape), a.param(name))
        assert a.grad(name).shape == a.param(name).shape


def test_whole_model_gradient_matches_finite_differences() -> None:
    rng = np.random.default_rng(0)
    model = Model(SMALL, dtype=np.float64)
    model.init_params(1)
    x = rng.random((4, 9, 9, 2))
    y = rng.integers(0, 3, 4)
    model.loss_and_grad(x, y)
    grads = model.grads.copy()
    params = model.params
    eps = 1e-6
    num = np.zeros_like(params)
    for i in range(params.size):
        old = params[i]
        params[i] = old + eps
        up = model.loss_and_grad(x, y)
        params[i] = old - eps
        down = model.loss_and_grad(x, y)
        params[i] = old
        num[i] = (up - down) / (2 * eps)
    np.testing.assert_allclose(grads, num, rtol=1e-5, atol=1e-8)


def test_adam_mnist_gradient_spot_check() -> None:
    """float64 adam-mnist: 12 random coordinates of every tensor against central differences."""
    rng = np.random.default_rng(1)
    model = Model("adam-mnist", dtype=np.float64)
    model.init_params(2)
    x = rng.random((2, 28, 28, 1))
    y = np.array([3, 7])
    model.loss_and_grad(x, y)
    grads = model.grads.copy()
    for _, sl in model.slices().items():
        for i in rng.integers(sl.start, sl.stop, 12):
            old = model.params[i]
            model.params[i] = old + 1e-6
            up = model.loss_and_grad(x, y)
            model.params[i] = old - 1e-6
            down = model.loss_and_grad(x, y)
            model.params[i] = old
            assert grads[i] == pytest.approx((up - down) / 2e-6, rel=1e-4, abs=1e-9)


def test_fc_error_vectors_reproduce_weight_gradients() -> None:
    rng = np.random.default_rng(4)
    model = Model("adam-mnist")
    model.init_params(0)
    model.loss_and_grad(rng.random((5, 28, 28, 1), np.float32), rng.integers(0, 10, 5))
    vectors = model.fc_vectors()
    assert sorted(vectors) == ["fc1.w", "fc2.w", "out.w"]
    for name, (a, e) in vectors.items():
        m, n = model.param(name).shape
        assert a.shape == (5, n) and e.shape == (5, m)
        np.testing.assert_allclose(e.T @ a, model.grad(name), rtol=1e-4, atol=1e-6)
        bias = name[:-2] + ".b"
        np.testing.assert_allclose(e.sum(axis=0), model.grad(bias), rtol=1e-4, atol=1e-6)


def test_batch_gradient_is_the_mean_of_single_image_gradients() -> None:
    """Also checks that per-batch-size work buffers do not leak state between sizes."""
    rng = np.random.default_rng(5)
    model = Model("adam-mnist", dtype=np.float64)
    model.init_params(0)
    x = rng.random((3, 28, 28, 1))
    y = np.array([1, 2, 3])
    singles = []
    for i in range(3):
        model.loss_and_grad(x[i : i + 1], y[i : i + 1])
        singles.append(model.grads.copy())
    model.loss_and_grad(x, y)
    np.testing.assert_allclose(model.grads, np.mean(singles, axis=0), rtol=1e-9, atol=1e-12)


def test_sgd_step_updates_the_shared_buffer() -> None:
    rng = np.random.default_rng(6)
    model = Model(SMALL)
    model.init_params(0)
    before = model.params.copy()
    x, y = rng.random((2, 9, 9, 2), np.float32), np.array([0, 2])
    model.sgd_step(x, y, 0.1)
    expected_grads = before - model.params
    check = Model(SMALL, params=before.copy())
    check.loss_and_grad(x, y)
    np.testing.assert_allclose(expected_grads, 0.1 * check.grads, rtol=1e-4, atol=1e-7)


def test_epoch_batches_cover_every_image_once() -> None:
    batches = epoch_batches(103, 8, seed=1, epoch=2)
    assert [len(b) for b in batches] == [8] * 12 + [7]
    assert sorted(np.concatenate(batches).tolist()) == list(range(103))
    again = epoch_batches(103, 8, seed=1, epoch=2)
    assert all(np.array_equal(a, b) for a, b in zip(batches, again, strict=True))


@pytest.mark.timeout(60)
def test_short_training_run_learns_mnist() -> None:
    """One epoch of plain SGD (batch 8, lr 0.03) on the 4,000 built-in training images:
    well above chance on the 1,000 held-out ones, in a few seconds."""
    start = time.monotonic()
    _, results = train_local("adam-mnist", epochs=1, batch=8, lr=0.03, seed=0)
    assert time.monotonic() - start < 30
    assert len(results) == 1 and results[0].images == 4000
    assert results[0].accuracy >= 0.85, results
