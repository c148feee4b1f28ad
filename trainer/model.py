"""Models described declaratively, with every parameter in one flat float32 buffer. Pure numpy.

A model description is a plain dict (JSON-serialisable)::

    {"name": "adam-mnist", "input": [28, 28, 1], "classes": 10,
     "layers": [{"type": "conv", "name": "conv1", "size": 5, "filters": 10, "activation": "relu"},
                {"type": "pool", "name": "pool1", "size": 2}, ...,
                {"type": "softmax", "name": "out", "units": 10}]}

The parameters are an ordered list of named tensors ("conv1.w", "conv1.b", ...), each a view
into one flat buffer: the list is what a parameter server registers, and the flat buffer is what
Hogwild workers share (it can live in shared memory). Gradients have their own flat buffer with
the same layout, so an SGD step is one vector operation over the whole model.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

import numpy as np

from adamps.layout import grouped, pack_groups
from trainer.layers import Dense, Layer, SoftmaxCrossEntropy, make_layer

ADAM_MNIST: dict[str, Any] = {
    "name": "adam-mnist",
    "input": [28, 28, 1],
    "classes": 10,
    "layers": [
        {"type": "conv", "name": "conv1", "size": 5, "filters": 10, "activation": "relu"},
        {"type": "pool", "name": "pool1", "size": 2},
        {"type": "conv", "name": "conv2", "size": 5, "filters": 20, "activation": "relu"},
        {"type": "pool", "name": "pool2", "size": 2},
        {"type": "fc", "name": "fc1", "units": 400, "activation": "relu"},
        {"type": "fc", "name": "fc2", "units": 400, "activation": "relu"},
        {"type": "softmax", "name": "out", "units": 10},
    ],
}

#: softmax regression: a convex problem, Sandblaster's correctness anchor (issue 14)
SOFTMAX_MNIST: dict[str, Any] = {
    "name": "softmax-mnist",
    "input": [28, 28, 1],
    "classes": 10,
    "layers": [{"type": "softmax", "name": "out", "units": 10}],
}

BUILTIN_MODELS: dict[str, dict[str, Any]] = {
    "adam-mnist": ADAM_MNIST,
    "softmax-mnist": SOFTMAX_MNIST,
}


def builtin(name: str) -> dict[str, Any]:
    """A copy of a built-in model description."""
    if name not in BUILTIN_MODELS:
        raise ValueError(f"unknown model {name!r}; built in: {sorted(BUILTIN_MODELS)}")
    return copy.deepcopy(BUILTIN_MODELS[name])


def resolve_spec(spec: str | dict[str, Any]) -> dict[str, Any]:
    """A built-in name, a JSON string or a description dict -> a validated description dict."""
    if isinstance(spec, str):
        spec = json.loads(spec) if spec.lstrip().startswith("{") else builtin(spec)
    if not isinstance(spec, dict) or not isinstance(spec.get("layers"), list):
        raise ValueError("a model description is a dict with a 'layers' list")
    if len(spec.get("input", ())) != 3:
        raise ValueError("'input' must be [height, width, channels]")
    if not spec["layers"] or spec["layers"][-1].get("type") != "softmax":
        raise ValueError("the last layer must be of type 'softmax'")
    names = [layer.get("name") for layer in spec["layers"]]
    if len(set(names)) != len(names):
        raise ValueError(f"layer names must be unique: {names}")
    return copy.deepcopy(spec)


def in_namespace(spec: dict[str, Any], run: str) -> dict[str, Any]:
    """`spec` with every layer named "<run>..<name>" (its tensors: "<run>..<name>.<w|b>"), the
    namespace of run `run` (adamps/runs.py); unchanged without a run."""
    if not run:
        return spec
    layers = [{**layer, "name": f"{run}..{layer['name']}"} for layer in spec["layers"]]
    return {**spec, "layers": layers}


def tensor_layout(spec: str | dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """The ordered (name, shape) list of a model's float32 tensors, without allocating them."""
    return Model(spec, params=np.empty(0, np.float32), _layout_only=True).tensors()


def fuse_layers(spec: dict[str, Any], run: str = "") -> dict[str, Any]:
    """`spec` (already in run `run`'s namespace) with its small layers in placement groups
    (``--fuse-tensors``): the code that packs adamps.torch's parameters (adamps/layout.py
    ``pack_groups``), applied to each layer's elements (weights and bias together) in the
    model's order, so a layer "RUN..conv1" of group 0 is "RUN..{0}conv1" and its tensors
    "RUN..{0}conv1.w" and ".b" share one bucket with the rest of the group."""
    sizes: dict[str, int] = {}
    counts: dict[str, int] = {}
    for name, shape in tensor_layout(spec):
        layer = name.rsplit(".", 1)[0]
        sizes[layer] = sizes.get(layer, 0) + math.prod(shape)
        counts[layer] = counts.get(layer, 0) + 1
    packed = pack_groups(list(sizes.values()), tensors=list(counts.values()))
    groups = dict(zip(sizes, packed, strict=True))
    ns = len(run) + 2 if run else 0  # after "RUN..": a group stays within its run
    layers = [
        {**layer, "name": grouped(layer["name"], str(g), ns)}
        if (g := groups.get(layer["name"])) is not None
        else layer
        for layer in spec["layers"]
    ]
    return {**spec, "layers": layers}


class Model:
    """One replica's network: the layers, views into a flat parameter buffer, a private
    gradient buffer and private work buffers.

    Several Model objects may share one parameter buffer (Hogwild workers); each has its own
    gradients and work buffers, so only the parameters are shared. A Model is used by one
    thread at a time.
    """

    def __init__(
        self,
        spec: str | dict[str, Any],
        params: np.ndarray | None = None,
        dtype: Any = np.float32,
        _layout_only: bool = False,
    ) -> None:
        self.spec = resolve_spec(spec)
        self.dtype = np.dtype(dtype)
        self.input_shape: tuple[int, ...] = tuple(int(v) for v in self.spec["input"])
        self.layers: list[Layer] = [make_layer(s, self.dtype) for s in self.spec["layers"]]
        shape = self.input_shape
        self._layout: list[tuple[str, tuple[int, ...], int, int]] = []  # name, shape, start, stop
        offset = 0
        for layer in self.layers:
            shape = layer.build(shape)
            for suffix, tshape in layer.param_shapes():
                size = int(np.prod(tshape))
                self._layout.append((f"{layer.name}.{suffix}", tshape, offset, offset + size))
                offset += size
        if shape != (int(self.spec.get("classes", shape[0])),):
            raise ValueError(f"output shape {shape} does not match classes {self.spec['classes']}")
        self.n_params = offset
        if _layout_only:
            return
        if params is None:
            params = np.zeros(self.n_params, self.dtype)
        if params.shape != (self.n_params,) or params.dtype != self.dtype:
            raise ValueError(
                f"params must be a flat {self.dtype} array of {self.n_params} values, "
                f"got {params.dtype} {params.shape}"
            )
        #: the flat parameter buffer (maybe shared with other workers); views below point into it
        self.params = params
        #: the flat gradient buffer of the last backward pass, same layout as params
        self.grads = np.zeros(self.n_params, self.dtype)
        self._p = [self._views(self.params, layer) for layer in self.layers]
        self._g = [self._views(self.grads, layer) for layer in self.layers]

    def _views(self, flat: np.ndarray, layer: Layer) -> dict[str, np.ndarray]:
        prefix = layer.name + "."
        return {
            name[len(prefix) :]: flat[start:stop].reshape(shape)
            for name, shape, start, stop in self._layout
            if name.startswith(prefix)
        }

    # -- description -------------------------------------------------------------------

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Ordered (name, shape) of the float32 parameter tensors: stable across processes."""
        return [(name, shape) for name, shape, _, _ in self._layout]

    def slices(self) -> dict[str, slice]:
        """Each tensor's slice of the flat buffers."""
        return {name: slice(start, stop) for name, _, start, stop in self._layout}

    def connections(self) -> int:
        """Forward multiply-accumulates per image (Project Adam's 'connections')."""
        return sum(layer.connections() for layer in self.layers)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.spec)

    def export(self) -> dict[str, np.ndarray]:
        """The weights as named arrays plus the description (key "model", JSON text): what
        ``np.savez(path, **model.export())`` writes and ``Model.from_export`` reads back."""
        out = {"model": np.array(json.dumps(self.spec))}
        for name, _ in self.tensors():
            out[name] = self.param(name).copy()
        return out

    @classmethod
    def from_export(cls, arrays: Any) -> Model:
        """Rebuild a model from ``export()``'s arrays (a dict or an opened .npz file)."""
        model = cls(json.loads(str(arrays["model"])))
        for name, shape in model.tensors():
            value = np.asarray(arrays[name])
            if value.shape != shape:
                raise ValueError(f"{name}: shape {value.shape}, expected {shape}")
            model.param(name)[...] = value
        return model

    def param(self, name: str) -> np.ndarray:
        """A view of one parameter tensor in the flat buffer."""
        layer, _, suffix = name.rpartition(".")
        for lyr, views in zip(self.layers, self._p, strict=True):
            if lyr.name == layer and suffix in views:
                return views[suffix]
        raise KeyError(name)

    def grad(self, name: str) -> np.ndarray:
        layer, _, suffix = name.rpartition(".")
        for lyr, views in zip(self.layers, self._g, strict=True):
            if lyr.name == layer and suffix in views:
                return views[suffix]
        raise KeyError(name)

    def init_params(self, seed: int = 0) -> None:
        """He-uniform weights for ReLU layers (Glorot-style fan-in scaling otherwise), zero biases."""
        rng = np.random.default_rng(seed)
        for layer, views in zip(self.layers, self._p, strict=True):
            if "w" not in views:
                continue
            gain = 6.0 if getattr(layer, "act", "linear") == "relu" else 3.0
            limit = np.sqrt(gain / layer.fan_in())
            views["w"][...] = rng.uniform(-limit, limit, views["w"].shape)
            views["b"][...] = 0.0

    # -- compute -----------------------------------------------------------------------

    def prepare(self, images: np.ndarray) -> np.ndarray:
        """uint8 images [B,H,W] or [B,H,W,C] -> the model's float input in [0, 1]."""
        x = np.asarray(images)
        scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
        return (x.reshape(x.shape[0], *self.input_shape) * scale).astype(self.dtype, copy=False)

    def forward(self, x: np.ndarray) -> np.ndarray:
        """Class scores (logits) of a prepared batch; the returned buffer is reused."""
        if x.shape[1:] != self.input_shape:
            x = x.reshape(x.shape[0], *self.input_shape)
        for layer, p in zip(self.layers, self._p, strict=True):
            x = layer.forward(x, p)
        return x

    def loss_and_grad(self, x: np.ndarray, labels: np.ndarray, scale: float = 1.0) -> float:
        """Forward and backward on one batch: returns the mean cross-entropy and fills
        ``self.grads`` (overwritten, not accumulated) and the fully connected layers' (a, e)
        with scale * the gradient (every gradient is linear in the output error)."""
        logits = self.forward(x)
        out = self.layers[-1]
        assert isinstance(out, SoftmaxCrossEntropy)
        loss, dy = out.loss_grad(logits, np.asarray(labels), scale)
        last = len(self.layers) - 1
        for i in range(last, -1, -1):
            dy = self.layers[i].backward(dy, self._p[i], self._g[i], need_dx=i > 0)
        return loss

    def sgd_step(self, x: np.ndarray, labels: np.ndarray, lr: float) -> float:
        """One plain SGD step on ``self.params`` (in place, lock-free if the buffer is shared)."""
        # -lr folded into the output error: one pass over the model instead of two
        loss = self.loss_and_grad(x, labels, scale=-lr)
        self.params += self.grads
        return loss

    def fc_vectors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """For each fully connected layer (softmax included): its weight tensor's name and the
        last backward pass's (a [k,N], e [k,M]) with grad W = e.T @ a and grad b = e.sum(0).
        Views of work buffers: copy before the next step if kept."""
        return {
            f"{layer.name}.w": (layer.a, layer.e)
            for layer in self.layers
            if isinstance(layer, Dense)
        }

    def predict(self, x: np.ndarray, batch: int = 500) -> np.ndarray:
        """Predicted class of each prepared image."""
        out = np.empty(x.shape[0], np.int64)
        for i in range(0, x.shape[0], batch):
            out[i : i + batch] = self.forward(x[i : i + batch]).argmax(axis=1)
        return out

    def accuracy(self, x: np.ndarray, labels: np.ndarray, batch: int = 500) -> float:
        """Fraction of prepared images classified correctly."""
        return float((self.predict(x, batch) == np.asarray(labels)).mean())
