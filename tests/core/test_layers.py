"""Layer gradients against central finite differences, in float64 (Project Adam 3.2: the
trainer's forward and backward passes)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer.layers import ACTIVATIONS, Conv, Dense, MaxPool, SoftmaxCrossEntropy, make_layer

EPS = 1e-6
TOL = 1e-6


def _params(layer, rng) -> dict[str, np.ndarray]:
    return {s: rng.normal(0, 0.5, shape) for s, shape in layer.param_shapes()}


def _check_layer(spec: dict, in_shape: tuple[int, ...], batch: int = 3, seed: int = 0) -> None:
    """L = sum(R * forward(x)) for a fixed random R: compare backward's dL/dx and dL/dparams
    with central differences of L at every input and parameter element."""
    rng = np.random.default_rng(seed)
    layer = make_layer(spec, np.float64)
    out_shape = layer.build(in_shape)
    p = _params(layer, rng)
    g = {s: np.zeros_like(v) for s, v in p.items()}
    x = rng.normal(0, 1, (batch, *in_shape))
    r = rng.normal(0, 1, (batch, *out_shape))

    def loss(xv: np.ndarray) -> float:
        return float(np.sum(layer.forward(xv.copy(), p) * r))

    loss(x)
    dx = layer.backward(r.copy(), p, g, need_dx=True)
    assert dx is not None and dx.shape == x.shape
    dx = dx.copy()

    num_dx = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        old = x[i]
        x[i] = old + EPS
        up = loss(x)
        x[i] = old - EPS
        down = loss(x)
        x[i] = old
        num_dx[i] = (up - down) / (2 * EPS)
    np.testing.assert_allclose(dx, num_dx, rtol=TOL, atol=TOL)

    for name, v in p.items():
        num = np.zeros_like(v)
        for i in np.ndindex(v.shape):
            old = v[i]
            v[i] = old + EPS
            up = loss(x)
            v[i] = old - EPS
            down = loss(x)
            v[i] = old
            num[i] = (up - down) / (2 * EPS)
        np.testing.assert_allclose(g[name], num, rtol=TOL, atol=TOL, err_msg=name)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_conv_gradients(activation: str) -> None:
    spec = {"type": "conv", "name": "c", "size": 3, "filters": 4, "activation": activation}
    _check_layer(spec, (6, 5, 2))


def test_conv_single_channel_and_batch_one() -> None:
    spec = {"type": "conv", "name": "c", "size": 2, "filters": 3, "activation": "tanh"}
    _check_layer(spec, (4, 4, 1), batch=1)


@pytest.mark.parametrize(("size", "in_shape"), [(2, (6, 4, 3)), (3, (6, 6, 2)), (2, (5, 7, 2))])
def test_pool_gradients(size: int, in_shape: tuple[int, ...]) -> None:
    # (5, 7): a ragged edge that the pool drops, and whose gradient must stay zero
    _check_layer({"type": "pool", "name": "p", "size": size}, in_shape)


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("batch", [1, 4])
def test_dense_gradients(activation: str, batch: int) -> None:
    spec = {"type": "fc", "name": "f", "units": 5, "activation": activation}
    _check_layer(spec, (2, 2, 3), batch=batch)


def test_softmax_cross_entropy_gradient() -> None:
    rng = np.random.default_rng(1)
    layer = SoftmaxCrossEntropy({"type": "softmax", "name": "out", "units": 4}, np.float64)
    layer.build((6,))
    p = _params(layer, rng)
    g = {s: np.zeros_like(v) for s, v in p.items()}
    x = rng.normal(0, 1, (5, 6))
    labels = rng.integers(0, 4, 5)

    def loss(xv: np.ndarray) -> float:
        logits = layer.forward(xv, p).copy()
        z = logits - logits.max(axis=1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
        return float(-logp[np.arange(5), labels].mean())

    expected = loss(x)
    # dz is the layer's logits buffer: no forward call in between
    value, dz = layer.loss_grad(layer.forward(x, p), labels)
    assert value == pytest.approx(expected, rel=1e-12)
    dx = layer.backward(dz, p, g, need_dx=True).copy()
    for arr, grad in [(x, dx), (p["w"], g["w"]), (p["b"], g["b"])]:
        num = np.zeros_like(arr)
        for i in np.ndindex(arr.shape):
            old = arr[i]
            arr[i] = old + EPS
            up = loss(x)
            arr[i] = old - EPS
            down = loss(x)
            arr[i] = old
            num[i] = (up - down) / (2 * EPS)
        np.testing.assert_allclose(grad, num, rtol=TOL, atol=TOL)


def test_dense_error_vectors_give_the_weight_gradient() -> None:
    """Project Adam 3.2.6: grad W (M x N) = e.T @ a for k activation vectors a (k x N) and
    error vectors e (k x M), so the server can compute the update from k*(M+N) numbers."""
    rng = np.random.default_rng(2)
    layer = Dense({"type": "fc", "name": "f", "units": 7, "activation": "relu"}, np.float32)
    layer.build((9,))
    p = {s: rng.normal(0, 0.5, shape).astype(np.float32) for s, shape in layer.param_shapes()}
    g = {s: np.zeros_like(v) for s, v in p.items()}
    layer.forward(rng.normal(0, 1, (4, 9)).astype(np.float32), p)
    layer.backward(rng.normal(0, 1, (4, 7)).astype(np.float32), p, g, need_dx=False)
    assert layer.a.shape == (4, 9) and layer.e.shape == (4, 7)
    np.testing.assert_allclose(layer.e.T @ layer.a, g["w"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.e.sum(axis=0), g["b"], rtol=1e-5, atol=1e-6)


def test_connections() -> None:
    conv = Conv({"type": "conv", "name": "c", "size": 5, "filters": 10}, np.float32)
    conv.build((28, 28, 1))
    assert conv.connections() == 25 * 24 * 24 * 10
    pool = MaxPool({"type": "pool", "name": "p", "size": 2}, np.float32)
    assert pool.build((24, 24, 10)) == (12, 12, 10) and pool.connections() == 0
    fc = Dense({"type": "fc", "name": "f", "units": 400}, np.float32)
    fc.build((4, 4, 20))
    assert fc.connections() == 320 * 400


@pytest.mark.parametrize(
    "spec",
    [
        {"type": "nope", "name": "x"},
        {"type": "conv", "size": 3, "filters": 2},
        {"type": "conv", "name": "c", "size": 3, "filters": 2, "activation": "swish"},
    ],
)
def test_bad_layer_specs_are_rejected(spec: dict) -> None:
    with pytest.raises(ValueError):
        make_layer(spec, np.float32).build((8, 8, 1))


def test_conv_kernel_larger_than_input_is_rejected() -> None:
    with pytest.raises(ValueError, match="larger"):
        make_layer({"type": "conv", "name": "c", "size": 5, "filters": 2}, np.float32).build(
            (4, 4, 1)
        )
