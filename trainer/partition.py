"""One replica's network cut vertically into K partitions (Project Adam 3.2, figure 6;
DistBelief 3). Pure numpy; the exchange between partitions is injected (trainer/exchange.py).

Partition k owns a slice of every layer: ``split(F, K)[k]`` of a convolution layer's F
feature maps (filters) and of a fully connected layer's M output units, the output layer's
classes included. Its parameters are the matching rows of each weight and bias, registered
on the parameter servers as tensors of their own (``conv1-p0of2.w``): a partition pulls and
pushes only its own tensors, and a fully connected slice (rows of W) keeps the act/err push
of Adam 3.2.6 (its activations are the whole input, its errors its own units').

What crosses a boundary: a layer with parameters needs its whole input, of which partition j
holds the slice ``ranges[j]`` of the last axis (NHWC: channels; fully connected: units). So
before each such layer (except on the image) the partitions **all-gather** the slices; pooling
is per channel and runs on the slice. Backward, a partition's filters give a partial error of
the whole input; the K partials are **reduce-scattered**, each partition summing its own slice.
Each value crosses a boundary once per partition that needs it, in each direction.

The output layer's scores (its classes sliced like any other units) are all-gathered so that
each partition computes the same softmax cross-entropy, then back-propagates its own classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trainer.layers import Dense, Layer, SoftmaxCrossEntropy, make_layer
from trainer.model import Model, resolve_spec

PARAM_KINDS = ("conv", "fc", "softmax")


def split(n: int, parts: int) -> list[tuple[int, int]]:
    """n units cut into ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        stop = start + base + (1 if k < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def units_of(layer_spec: dict[str, Any]) -> int:
    return int(layer_spec["filters"] if layer_spec["type"] == "conv" else layer_spec["units"])


def part_name(layer: str, k: int, parts: int) -> str:
    """A partition's name for a layer: its tensors are ``<layer>-p<k>of<K>.w`` / ``.b``."""
    return f"{layer}-p{k}of{parts}"


def check_partitions(spec: str | dict[str, Any], parts: int) -> dict[str, Any]:
    """The resolved description, if every layer with parameters can give each partition a unit."""
    spec = resolve_spec(spec)
    if parts < 1:
        raise ValueError(f"partitions must be >= 1, got {parts}")
    for layer in spec["layers"]:
        if layer["type"] in PARAM_KINDS and units_of(layer) < parts:
            raise ValueError(
                f"layer {layer['name']} has {units_of(layer)} units/filters: cannot give each "
                f"of {parts} partitions one"
            )
    return spec


def partition_tensors(
    spec: str | dict[str, Any], k: int, parts: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Partition k's (name, shape) tensors, without allocating them."""
    return PartitionModel(spec, k, parts, _layout_only=True).tensors()


def slice_params(full: Model, k: int, parts: int) -> dict[str, np.ndarray]:
    """Partition k's tensors cut out of an unpartitioned model's weights (copies)."""
    out = {}
    for layer in full.layers:
        if layer.kind not in PARAM_KINDS:
            continue
        lo, hi = split(units_of(layer.spec), parts)[k]
        name = part_name(layer.name, k, parts)
        out[f"{name}.w"] = full.param(f"{layer.name}.w")[lo:hi].copy()
        out[f"{name}.b"] = full.param(f"{layer.name}.b")[lo:hi].copy()
    return out


def assemble(spec: str | dict[str, Any], parts: int, tensors: dict[str, np.ndarray]) -> Model:
    """The unpartitioned model from every partition's tensors (evaluation, export)."""
    full = Model(spec)
    for layer in full.layers:
        if layer.kind not in PARAM_KINDS:
            continue
        for suffix in ("w", "b"):
            full.param(f"{layer.name}.{suffix}")[...] = np.concatenate(
                [tensors[f"{part_name(layer.name, k, parts)}.{suffix}"] for k in range(parts)]
            )
    return full


def max_message_bytes(spec: str | dict[str, Any], parts: int, batch: int) -> int:
    """The largest message one partition sends in one exchange at this batch size: what a
    shared-memory segment must hold."""
    full = Model(resolve_spec(spec), params=np.empty(0, np.float32), _layout_only=True)
    most = full.layers[-1].out_shape[0]  # the logits' all-gather
    for i, layer in enumerate(full.layers):
        if layer.kind in PARAM_KINDS and i > 0:  # a slice of its input, either way
            *rest, channels = layer.in_shape
            most = max(most, int(np.prod(rest)) * -(-channels // parts))
    return max(most, 1) * batch * 4


class _Step:
    """One layer of a partition and what crosses the boundary before it."""

    def __init__(
        self, layer: Layer, gather: list[tuple[int, int]] | None, in_full: tuple[int, ...]
    ):
        self.layer = layer
        #: ranges of the input's last axis held by each partition (None: the input is whole)
        self.gather = gather
        self.in_full = in_full  #: per-image shape of the whole input
        self._bufs: dict[int, np.ndarray] = {}
        self._errs: dict[int, np.ndarray] = {}
        self.sliced = False  #: a per-channel layer working on a slice (its errors go down)

    def whole(self, batch: int, dtype: np.dtype) -> np.ndarray:
        buf = self._bufs.get(batch)
        if buf is None:
            if len(self._bufs) >= 4:
                del self._bufs[next(iter(self._bufs))]
            buf = self._bufs[batch] = np.empty((batch, *self.in_full), dtype)
        return buf

    def error(self, batch: int, width: int, dtype: np.dtype) -> np.ndarray:
        """This partition's slice of the error of the whole input (reduce-scattered)."""
        buf = self._errs.get(batch)
        if buf is None:
            if len(self._errs) >= 4:
                del self._errs[next(iter(self._errs))]
            buf = self._errs[batch] = np.empty((batch, *self.in_full[:-1], width), dtype)
        return buf


class PartitionModel:
    """Partition k of K of a model: its layers' slices, its parameters in one flat buffer (the
    Model interface the Downpour workers use), and an exchange with the other partitions.

    With K = 1 it computes what Model computes (and never touches the exchange)."""

    def __init__(
        self,
        spec: str | dict[str, Any],
        k: int,
        parts: int,
        exchange: Any = None,
        params: np.ndarray | None = None,
        dtype: Any = np.float32,
        _layout_only: bool = False,
    ) -> None:
        self.spec = check_partitions(spec, parts)
        if not 0 <= k < parts:
            raise ValueError(f"partition {k} out of 0..{parts - 1}")
        self.k, self.parts = k, parts
        self.exchange = exchange
        self.dtype = np.dtype(dtype)
        full = Model(self.spec, params=np.empty(0, np.float32), _layout_only=True)
        self.input_shape = full.input_shape
        self.steps: list[_Step] = []
        self.layers: list[Layer] = []
        self._layout: list[tuple[str, tuple[int, ...], int, int]] = []
        ranges: list[tuple[int, int]] | None = None  # slices of the current activation
        offset = 0
        for fl in full.layers:
            lspec = dict(fl.spec, name=part_name(fl.name, k, parts))
            if fl.kind in PARAM_KINDS:
                own = split(units_of(fl.spec), parts)
                key = "filters" if fl.kind == "conv" else "units"
                lspec[key] = own[k][1] - own[k][0]
                layer = make_layer(lspec, self.dtype)
                layer.build(fl.in_shape)  # the whole input
                step = _Step(layer, ranges, fl.in_shape)
                ranges = own
            else:  # per channel: runs on the slice (or on the whole input before any cut)
                layer = make_layer(lspec, self.dtype)
                shape = fl.in_shape
                if ranges is not None:
                    shape = (*fl.in_shape[:-1], ranges[k][1] - ranges[k][0])
                layer.build(shape)
                step = _Step(layer, None, fl.in_shape)
                step.sliced = ranges is not None
            self.steps.append(step)
            self.layers.append(layer)
            for suffix, tshape in layer.param_shapes():
                size = int(np.prod(tshape))
                self._layout.append((f"{layer.name}.{suffix}", tshape, offset, offset + size))
                offset += size
        self.out_ranges = ranges or [(0, full.layers[-1].out_shape[0])]
        self.classes = full.layers[-1].out_shape[0]
        self.n_params = offset
        if _layout_only:
            return
        if params is None:
            params = np.zeros(self.n_params, self.dtype)
        if params.shape != (self.n_params,) or params.dtype != self.dtype:
            raise ValueError(f"params must be a flat {self.dtype} array of {self.n_params} values")
        self.params = params
        self.grads = np.zeros(self.n_params, self.dtype)
        self._p = [self._views(self.params, layer) for layer in self.layers]
        self._g = [self._views(self.grads, layer) for layer in self.layers]
        self._logits: dict[int, np.ndarray] = {}

    def _views(self, flat: np.ndarray, layer: Layer) -> dict[str, np.ndarray]:
        prefix = layer.name + "."
        return {
            name[len(prefix) :]: flat[start:stop].reshape(shape)
            for name, shape, start, stop in self._layout
            if name.startswith(prefix)
        }

    # -- the Model interface ---------------------------------------------------------------

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        return [(name, shape) for name, shape, _, _ in self._layout]

    def slices(self) -> dict[str, slice]:
        return {name: slice(start, stop) for name, _, start, stop in self._layout}

    def connections(self) -> int:
        """This partition's forward multiply-accumulates per image."""
        return sum(layer.connections() for layer in self.layers)

    def param(self, name: str) -> np.ndarray:
        sl, shape = self.slices()[name], dict(self.tensors())[name]
        return self.params[sl].reshape(shape)

    def grad(self, name: str) -> np.ndarray:
        sl, shape = self.slices()[name], dict(self.tensors())[name]
        return self.grads[sl].reshape(shape)

    def prepare(self, images: np.ndarray) -> np.ndarray:
        x = np.asarray(images)
        scale = 1.0 / 255.0 if x.dtype == np.uint8 else 1.0
        return (x.reshape(x.shape[0], *self.input_shape) * scale).astype(self.dtype, copy=False)

    # -- compute ---------------------------------------------------------------------------

    def forward(self, x: np.ndarray) -> np.ndarray:
        """The whole logits (every partition gets all of them); the buffer is reused."""
        b = x.shape[0]
        if x.shape[1:] != self.input_shape:
            x = x.reshape(b, *self.input_shape)
        for step, p in zip(self.steps, self._p, strict=True):
            if step.gather is not None and self.parts > 1:
                whole = step.whole(b, self.dtype)
                self.exchange.all_gather(x, whole, step.gather)
                x = whole
            x = step.layer.forward(x, p)
        if self.parts == 1:
            return x
        logits = self._logits.get(b)
        if logits is None:
            logits = self._logits[b] = np.empty((b, self.classes), self.dtype)
        self.exchange.all_gather(x, logits, self.out_ranges)
        return logits

    def loss_and_grad(self, x: np.ndarray, labels: np.ndarray, scale: float = 1.0) -> float:
        """Forward and backward of the whole replica, this partition's share: fills
        ``self.grads`` and the fc layers' (a, e) like Model.loss_and_grad."""
        logits = self.forward(x)
        out = self.layers[-1]
        assert isinstance(out, SoftmaxCrossEntropy)
        loss, dy = out.loss_grad(logits, np.asarray(labels), scale)
        lo, hi = self.out_ranges[self.k]
        dy = dy[:, lo:hi]
        for i in range(len(self.steps) - 1, -1, -1):
            step = self.steps[i]
            need = step.gather is not None or step.sliced
            dx = step.layer.backward(dy, self._p[i], self._g[i], need_dx=need)
            if not need:
                break  # everything below works on the image: no errors to send down
            if step.gather is not None and self.parts > 1:
                lo, hi = step.gather[self.k]
                mine = step.error(dx.shape[0], hi - lo, self.dtype)
                self.exchange.reduce_scatter(dx, mine, step.gather)
                dx = mine
            dy = dx
        return loss

    def fc_vectors(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        return {
            f"{layer.name}.w": (layer.a, layer.e)
            for layer in self.layers
            if isinstance(layer, Dense)
        }
