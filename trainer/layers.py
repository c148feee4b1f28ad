"""Neural-network layers in pure numpy: forward and backward, no IO.

Tensors are laid out NHWC (batch, height, width, channels) so that im2col needs no transposes:
the patch matrix times the filter matrix is already the NHWC output.

Every layer owns preallocated work buffers, one set per batch size, reused on every step: at the
small batches this trainer runs (1-32 images) allocation and page faults would otherwise cost as
much as the arithmetic. A layer never allocates its parameters: it gets views into the model's
flat parameter and gradient buffers (see trainer/model.py), so the same layer code runs on a
private buffer or on one shared between Hogwild workers.

Buffers returned by ``forward``/``backward`` belong to the layer and are overwritten by the
next call with the same batch size: copy them if you keep them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

ACTIVATIONS = ("relu", "tanh", "sigmoid", "linear")
#: work buffers are kept for this many batch sizes (training, last partial batch, evaluation)
_MAX_BATCH_SIZES = 4


def _activate(kind: str, y: np.ndarray) -> None:
    """Apply the activation in place."""
    if kind == "relu":
        np.maximum(y, 0, out=y)
    elif kind == "tanh":
        np.tanh(y, out=y)
    elif kind == "sigmoid":
        # sigmoid(x) = (1 + tanh(x/2)) / 2: in place and overflow free, unlike 1/(1+exp(-x))
        y *= 0.5
        np.tanh(y, out=y)
        y += 1.0
        y *= 0.5


def _activate_backward(kind: str, y: np.ndarray, dy: np.ndarray, tmp: np.ndarray) -> None:
    """dy *= f'(pre-activation), written in terms of the output y; dy is modified in place."""
    if kind == "relu":
        # the derivative is 0 or 1: a boolean multiply, tmp is a bool buffer
        np.greater(y, 0, out=tmp)
        np.multiply(dy, tmp, out=dy)
    elif kind == "tanh":
        np.multiply(y, y, out=tmp)
        np.subtract(1.0, tmp, out=tmp)
        np.multiply(dy, tmp, out=dy)
    elif kind == "sigmoid":
        np.subtract(1.0, y, out=tmp)
        tmp *= y
        np.multiply(dy, tmp, out=dy)


def _act_tmp(kind: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray | None:
    if kind == "linear":
        return None
    return np.empty(shape, dtype=bool if kind == "relu" else dtype)


class Layer:
    """Base class. ``build`` fixes shapes; ``forward``/``backward`` run one batch."""

    #: layer type as it appears in the model description
    kind = ""

    def __init__(self, spec: dict[str, Any], dtype: Any) -> None:
        self.spec = dict(spec)
        #: tensor name prefix ("conv1" -> "conv1.w", "conv1.b"); parameterless layers have one too
        self.name: str = spec["name"]
        self.dtype = np.dtype(dtype)
        self.in_shape: tuple[int, ...] = ()
        self.out_shape: tuple[int, ...] = ()
        self._bufs: dict[int, dict[str, np.ndarray | None]] = {}

    def build(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Fix the per-image input shape; return the per-image output shape."""
        raise NotImplementedError

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(suffix, shape) of each parameter tensor, in a stable order."""
        return []

    def connections(self) -> int:
        """Forward multiply-accumulates per image."""
        return 0

    def fan_in(self) -> int:
        return 1

    def _buffers(self, batch: int) -> dict[str, np.ndarray | None]:
        bufs = self._bufs.get(batch)
        if bufs is None:
            if len(self._bufs) >= _MAX_BATCH_SIZES:  # e.g. a caller with ever-changing sizes
                del self._bufs[next(iter(self._bufs))]
            bufs = self._bufs[batch] = self._allocate(batch)
        return bufs

    def _allocate(self, batch: int) -> dict[str, np.ndarray | None]:
        raise NotImplementedError

    def forward(self, x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def backward(
        self, dy: np.ndarray, p: dict[str, np.ndarray], g: dict[str, np.ndarray], need_dx: bool
    ) -> np.ndarray | None:
        """Write parameter gradients into g's views; return dL/dx when need_dx."""
        raise NotImplementedError


class Conv(Layer):
    """Valid 2-D convolution, stride 1, via im2col (stride tricks) and one sgemm.

    Weight shape (filters, kh, kw, in_channels): one row per output channel, like a fully
    connected layer's (outputs, inputs), so a parameter server can cut it on whole rows.
    """

    kind = "conv"

    def build(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        h, w, c = in_shape
        self.k = int(self.spec["size"])
        self.f = int(self.spec["filters"])
        self.act = self.spec.get("activation", "relu")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"{self.name}: unknown activation {self.act!r}")
        if self.k > h or self.k > w:
            raise ValueError(f"{self.name}: kernel {self.k} larger than input {h}x{w}")
        self.in_shape = (h, w, c)
        self.oh, self.ow = h - self.k + 1, w - self.k + 1
        self.kk = self.k * self.k * c
        self.out_shape = (self.oh, self.ow, self.f)
        return self.out_shape

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        c = self.in_shape[2]
        return [("w", (self.f, self.k, self.k, c)), ("b", (self.f,))]

    def connections(self) -> int:
        return self.kk * self.oh * self.ow * self.f

    def fan_in(self) -> int:
        return self.kk

    def _allocate(self, batch: int) -> dict[str, np.ndarray | None]:
        rows = batch * self.oh * self.ow
        bufs: dict[str, np.ndarray | None] = {
            "y": np.empty((rows, self.f), self.dtype),
            "tmp": _act_tmp(self.act, (rows, self.f), self.dtype),
        }
        if self.in_shape[2] == 1:
            # One input channel: patches stored transposed, (k*k + 1, rows), so the im2col
            # copy runs along output rows (inner loop ow long, not k*c = 5 long: 3x faster);
            # the extra row of ones folds the bias into the same sgemm, forward and backward.
            cols_t = np.empty((self.kk + 1, rows), self.dtype)
            cols_t[self.kk] = 1.0
            bufs["colsT"] = cols_t
            bufs["waug"] = np.empty((self.kk + 1, self.f), self.dtype)
            bufs["gaug"] = np.empty((self.f, self.kk + 1), self.dtype)
        else:
            bufs["cols"] = np.empty((rows, self.kk), self.dtype)
            bufs["ones"] = np.ones(rows, self.dtype)
        return bufs

    def forward(self, x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
        b = x.shape[0]
        bufs = self._buffers(b)
        x = np.ascontiguousarray(x, dtype=self.dtype)
        sb, sh, sw, sc = x.strides
        k, c = self.k, self.in_shape[2]
        y = bufs["y"]
        w = p["w"].reshape(self.f, self.kk)
        if "colsT" in bufs:
            cols_t, waug = bufs["colsT"], bufs["waug"]
            patches = as_strided(
                x, (k, k, b, self.oh, self.ow), (sh, sw, sb, sh, sw), writeable=False
            )
            np.copyto(cols_t[: self.kk].reshape(k, k, b, self.oh, self.ow), patches)
            np.copyto(waug[: self.kk], w.T)
            waug[self.kk] = p["b"]
            np.matmul(cols_t.T, waug, out=y)
        else:
            patches = as_strided(
                x, (b, self.oh, self.ow, k, k, c), (sb, sh, sw, sh, sw, sc), writeable=False
            )
            cols = bufs["cols"]
            np.copyto(cols.reshape(b, self.oh, self.ow, k, k, c), patches)
            np.matmul(cols, w.T, out=y)
            y += p["b"]
        _activate(self.act, y)
        self._x = x
        return y.reshape(b, self.oh, self.ow, self.f)

    def backward(
        self, dy: np.ndarray, p: dict[str, np.ndarray], g: dict[str, np.ndarray], need_dx: bool
    ) -> np.ndarray | None:
        b = dy.shape[0]
        bufs = self._buffers(b)
        e = dy.reshape(-1, self.f)
        _activate_backward(self.act, bufs["y"], e, bufs["tmp"])
        if "colsT" in bufs:
            gaug = bufs["gaug"]
            np.matmul(e.T, bufs["colsT"].T, out=gaug)
            np.copyto(g["w"].reshape(self.f, self.kk), gaug[:, : self.kk])
            np.copyto(g["b"], gaug[:, self.kk])
        else:
            np.matmul(e.T, bufs["cols"], out=g["w"].reshape(self.f, self.kk))
            # a bias gradient as ones @ e (gemv) is 7x faster than np.sum(axis=0) here
            np.matmul(bufs["ones"], e, out=g["b"])
        if not need_dx:
            return None
        return self._dx(e, p, bufs, b)

    def _dx(
        self, e: np.ndarray, p: dict[str, np.ndarray], bufs: dict[str, Any], b: int
    ) -> np.ndarray:
        """dL/dx from the errors e (rows, filters): the transposed convolution."""
        k, c = self.k, self.in_shape[2]
        if "dcols" not in bufs:  # backward-only buffers: evaluation batches never need them
            bufs["wt"] = np.empty((k * k, self.f, c), self.dtype)
            bufs["dcols"] = np.empty((k * k, e.shape[0], c), self.dtype)
            bufs["dx"] = np.empty((b, *self.in_shape), self.dtype)
        # dL/dcols computed per kernel offset, (k*k, rows, c): each offset's block is then
        # contiguous for the col2im scatter-add (gathering from the (rows, k*k*c) layout was
        # 2.5x slower). The patches overlap, so the scatter-adds go one offset at a time.
        wt = bufs["wt"]
        np.copyto(wt.reshape(k, k, self.f, c), p["w"].transpose(1, 2, 0, 3))
        dcols = bufs["dcols"]
        np.matmul(e, wt, out=dcols)
        d = dcols.reshape(k, k, b, self.oh, self.ow, c)
        dx = bufs["dx"]
        dx.fill(0)
        for i in range(k):
            for j in range(k):
                dx[:, i : i + self.oh, j : j + self.ow, :] += d[i, j]
        return dx


class MaxPool(Layer):
    """Non-overlapping max-pooling (window = stride = size); a ragged edge is dropped.

    Forward is size*size-1 np.maximum calls over strided slabs (a reshape + max reduction
    was 5x slower). Backward routes the gradient to every slab element equal to the max;
    exact ties (measure zero for real-valued inputs, and killed by the ReLU derivative when
    they are zeros after a ReLU) would each receive the full gradient.
    """

    kind = "pool"

    def build(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        h, w, c = in_shape
        self.p = int(self.spec.get("size", 2))
        if self.p < 1 or self.p > h or self.p > w:
            raise ValueError(f"{self.name}: bad pool size {self.p} for input {h}x{w}")
        self.in_shape = (h, w, c)
        self.out_shape = (h // self.p, w // self.p, c)
        self.ragged = h % self.p != 0 or w % self.p != 0
        return self.out_shape

    def _allocate(self, batch: int) -> dict[str, np.ndarray | None]:
        h, w, c = self.in_shape
        dx = np.empty((batch, h, w, c), self.dtype)
        if self.ragged:
            dx.fill(0)  # the dropped edge never gets a gradient: zero it once
        return {
            "y": np.empty((batch, *self.out_shape), self.dtype),
            "mask": np.empty((batch, *self.out_shape), bool),
            "dx": dx,
        }

    def _slab(self, a: np.ndarray, i: int, j: int) -> np.ndarray:
        ph, pw = self.out_shape[0] * self.p, self.out_shape[1] * self.p
        return a[:, i : ph : self.p, j : pw : self.p, :]

    def forward(self, x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
        bufs = self._buffers(x.shape[0])
        y = bufs["y"]
        s = self.p
        if s == 1:
            np.copyto(y, x)
        else:
            np.maximum(self._slab(x, 0, 0), self._slab(x, 0, 1), out=y)
            for n in range(2, s * s):
                np.maximum(y, self._slab(x, n // s, n % s), out=y)
        self._x = x
        return y

    def backward(
        self, dy: np.ndarray, p: dict[str, np.ndarray], g: dict[str, np.ndarray], need_dx: bool
    ) -> np.ndarray | None:
        if not need_dx:
            return None
        b = dy.shape[0]
        bufs = self._buffers(b)
        y, dx = bufs["y"], bufs["dx"]
        if not self.ragged:
            # windows tile the input: view it as (b, oh, p, ow, p, c) and compare against the
            # broadcast maxima in one call (2 numpy calls instead of 2 per window offset)
            (oh, ow, c), s = self.out_shape, self.p
            if "mask6" not in bufs:
                bufs["mask6"] = np.empty((b, oh, s, ow, s, c), bool)
            mask6 = bufs["mask6"]
            np.equal(self._x.reshape(mask6.shape), y[:, :, None, :, None, :], out=mask6)
            np.multiply(dy[:, :, None, :, None, :], mask6, out=dx.reshape(mask6.shape))
            return dx
        mask = bufs["mask"]
        for i in range(self.p):
            for j in range(self.p):
                np.equal(self._slab(self._x, i, j), y, out=mask)
                np.multiply(dy, mask, out=self._slab(dx, i, j))
        return dx


class Dense(Layer):
    """Fully connected: y = f(a @ W.T + b) with W of shape (outputs M, inputs N).

    After backward, ``a`` (k x N, this layer's input) and ``e`` (k x M, the error at the
    pre-activation) hold the per-sample vectors with grad W = e.T @ a and grad b = e.sum(0):
    what Project Adam (3.2.6) sends to the parameter server instead of the M x N delta.
    """

    kind = "fc"

    def build(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        self.n = int(np.prod(in_shape))
        self.m = int(self.spec["units"])
        self.act = self.spec.get("activation", "relu")
        if self.act not in ACTIVATIONS:
            raise ValueError(f"{self.name}: unknown activation {self.act!r}")
        self.in_shape = tuple(in_shape)
        self.out_shape = (self.m,)
        return self.out_shape

    def param_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        return [("w", (self.m, self.n)), ("b", (self.m,))]

    def connections(self) -> int:
        return self.m * self.n

    def fan_in(self) -> int:
        return self.n

    def _allocate(self, batch: int) -> dict[str, np.ndarray | None]:
        # Outputs and errors are kept transposed, (M, k): then the big operand W enters
        # sgemm untransposed in both W @ a.T and e @ W; OpenBLAS's small-k kernels with a
        # transposed W were up to 2x slower at batch 8-32.
        return {
            "yT": np.empty((self.m, batch), self.dtype),
            "tmp": _act_tmp(self.act, (self.m, batch), self.dtype),
            "eT": np.empty((self.m, batch), self.dtype),
            "ones": np.ones(batch, self.dtype),
            "dx": np.empty((batch, self.n), self.dtype),
        }

    def forward(self, x: np.ndarray, p: dict[str, np.ndarray]) -> np.ndarray:
        b = x.shape[0]
        bufs = self._buffers(b)
        a = x.reshape(b, self.n)
        y_t = bufs["yT"]
        np.matmul(p["w"], a.T, out=y_t)
        y_t += p["b"][:, None]
        _activate(self.act, y_t)
        self.a = a
        return y_t.T

    def backward(
        self, dy: np.ndarray, p: dict[str, np.ndarray], g: dict[str, np.ndarray], need_dx: bool
    ) -> np.ndarray | None:
        b = dy.shape[0]
        bufs = self._buffers(b)
        e_t = bufs["eT"]
        np.copyto(e_t, dy.T)
        _activate_backward(self.act, bufs["yT"], e_t, bufs["tmp"])
        self.e = e_t.T
        if b == 1:
            # numpy's matmul with an inner dimension of 1 skips BLAS: a broadcast outer product
            np.multiply(e_t, self.a, out=g["w"])
        else:
            np.matmul(e_t, self.a, out=g["w"])
        np.matmul(e_t, bufs["ones"], out=g["b"])
        if not need_dx:
            return None
        dx = bufs["dx"]
        np.matmul(e_t.T, p["w"], out=dx)
        return dx.reshape(b, *self.in_shape)


class SoftmaxCrossEntropy(Dense):
    """The output layer: a linear fully connected layer whose outputs are class scores,
    trained with softmax cross-entropy averaged over the batch."""

    kind = "softmax"

    def build(self, in_shape: tuple[int, ...]) -> tuple[int, ...]:
        spec = dict(self.spec)
        spec["activation"] = "linear"
        self.spec = spec
        return super().build(in_shape)

    def loss_grad(
        self, logits: np.ndarray, labels: np.ndarray, scale: float = 1.0
    ) -> tuple[float, np.ndarray]:
        """Mean cross-entropy and scale * dL/dlogits (written over the logits buffer)."""
        b = logits.shape[0]
        z = logits
        z -= z.max(axis=1, keepdims=True)
        np.exp(z, out=z)
        z /= z.sum(axis=1, keepdims=True)
        rows = np.arange(b)
        picked = z[rows, labels]
        loss = float(-np.log(np.maximum(picked, 1e-30, dtype=np.float64)).mean())
        z[rows, labels] -= 1.0
        z *= scale / b
        return loss, z


LAYER_TYPES: dict[str, type[Layer]] = {
    "conv": Conv,
    "pool": MaxPool,
    "fc": Dense,
    "softmax": SoftmaxCrossEntropy,
}


def make_layer(spec: dict[str, Any], dtype: Any) -> Layer:
    """Build one layer from its description (a plain dict)."""
    kind = spec.get("type")
    if kind not in LAYER_TYPES:
        raise ValueError(f"unknown layer type {kind!r}; known: {sorted(LAYER_TYPES)}")
    if "name" not in spec:
        raise ValueError(f"layer {spec!r} has no name")
    return LAYER_TYPES[kind](spec, dtype)
