"""Activation and error vectors of ``nn.Linear`` layers (Adam 3.2.6), captured by hooks.

A layer ``y = x @ W.T + b`` with W of M x N has the weight gradient ``e.T @ a`` summed over the
rows of a pass: ``a`` its inputs (k x N) and ``e`` the gradients of the loss with respect to its
outputs (k x M). A forward hook keeps ``a`` and hangs a tensor hook on the output that keeps
``e`` when the backward pass reaches it: exactly what autograd uses for ``W.grad``, including the
loss's own scaling (a mean over the batch is already in ``e``). Inputs with more dimensions
(sequences) are flattened to rows. A layer called several times in one pass (a shared layer, a
recurrent step) records one pair per call: the gradient is their sum.

The rows are the weight's gradient only when every path from the loss to the weight goes
through the layer's outputs in the passes ``backward`` accumulated. A penalty on the weight in
the loss (an L2 term, an orthogonality term), a ``torch.autograd.grad`` to the inputs before
``backward`` (a saliency map: its errors are recorded, nothing is accumulated) or a gradient
penalty (``create_graph=True``: second-order terms) break that, silently. So the step checks
the rows against the gradient before it sends them (``rows_agree``: Freivalds' check, a product
with one fixed random vector, about ``2 * M * N`` operations against the pass's ``3 * k * M *
N``), and a layer whose rows disagree pushes its gradient instead.

Records are per thread: each Hogwild worker runs its own forward and backward passes and takes
only its own rows. A forward without a backward (evaluation with grad on) leaves a record
without errors, which ``take`` drops.
"""

from __future__ import annotations

import math
import threading
import zlib
from typing import Any

import numpy as np
import torch
from torch import nn


class ActErrCapture:
    """Hooks on the given layers (server tensor -> layers sharing that weight)."""

    def __init__(self, layers: dict[str, list[nn.Linear]]) -> None:
        self.layers = layers
        self._local = threading.local()
        self._handles: list[Any] = []
        #: tensor -> (the weight's .grad, its version) as backward left it: a loop that then
        #: changes .grad (clipping, an added penalty) makes the rows stale (``edited``)
        self._after_backward: dict[str, tuple[torch.Tensor, int]] = {}
        #: the tensors whose weight has its after-accumulation hook: torch refuses one on a
        #: tensor that does not require grad (a frozen layer), which gets it at its first
        #: forward after being unfrozen
        self._grad_hooked: set[str] = set()
        self._hook_lock = threading.Lock()
        for tensor, mods in layers.items():
            for mod in mods:
                self._handles.append(mod.register_forward_hook(self._hook(tensor, mod)))
            self._hook_grad(tensor)

    def _hook_grad(self, tensor: str) -> None:
        weight = self.layers[tensor][0].weight
        if tensor in self._grad_hooked or not weight.requires_grad:
            return
        with self._hook_lock:
            if tensor not in self._grad_hooked:
                self._handles.append(
                    weight.register_post_accumulate_grad_hook(self._grad_hook(tensor))
                )
                self._grad_hooked.add(tensor)

    def _records(self) -> dict[str, list[list[Any]]]:
        recs = getattr(self._local, "records", None)
        if recs is None:
            recs = self._local.records = {}
        return recs

    def _hook(self, tensor: str, mod: nn.Linear) -> Any:
        n_in, n_out = mod.in_features, mod.out_features

        def forward_hook(_mod: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
            if not (torch.is_grad_enabled() and mod.weight.requires_grad):
                return
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return
            self._hook_grad(tensor)
            rec: list[Any] = [inputs[0].detach().reshape(-1, n_in), None]
            self._records().setdefault(tensor, []).append(rec)

            def grad_hook(g: torch.Tensor) -> None:
                e = g.detach().reshape(-1, n_out)
                rec[1] = e if rec[1] is None else rec[1] + e  # backward(retain_graph) twice

            output.register_hook(grad_hook)

        return forward_hook

    def _grad_hook(self, tensor: str) -> Any:
        def after_accumulate(weight: torch.Tensor) -> None:
            if weight.grad is not None:
                self._after_backward[tensor] = (weight.grad, weight.grad._version)

        return after_accumulate

    def edited(self, tensor: str, grad: torch.Tensor | None) -> bool:
        """Whether `grad` (the weight's .grad at step()) is not what backward left: replaced
        or changed in place since (torch.nn.utils.clip_grad_norm_ scales it in place). Its rows
        are then not its gradient, and the layer pushes `grad` itself. A gradient that backward
        did not accumulate (Hogwild workers' torch.autograd.grad) is never edited."""
        seen = self._after_backward.get(tensor)
        if grad is None or seen is None:
            return False
        return grad is not seen[0] or grad._version != seen[1]

    def take(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """This thread's rows since the last take: tensor -> (a k x N, e k x M), float32 numpy
        (of a model on the CPU; see ``take_tensors``)."""
        return {
            t: (a.to("cpu", torch.float32).numpy(), e.to("cpu", torch.float32).numpy())
            for t, (a, e) in self.take_tensors().items()
        }

    def take_tensors(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """This thread's rows since the last take as tensors on the model's device, in its
        dtype: tensor -> (a k x N, e k x M). The caller copies them to the host
        (adamps/torch/staging.py), with the step's other gradients."""
        recs = self._records()
        self._local.records = {}
        out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for tensor, rows in recs.items():
            done = [r for r in rows if r[1] is not None]
            if not done:
                continue
            # a copy even of one record: `a` may be a view of the caller's input, kept past
            # this step until the push (n_push > 1)
            out[tensor] = (torch.cat([r[0] for r in done]), torch.cat([r[1] for r in done]))
        return out

    def discard(self) -> None:
        """Forgets this thread's rows (a step that pushes nothing, e.g. a skipped batch)."""
        self._local.records = {}

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def probe_for(tensor: str, n: int, device: torch.device) -> torch.Tensor:
    """The fixed random vector (float32, `n`) that ``rows_agree`` multiplies by: normal values,
    seeded by the tensor's name (no 0 or +-1 pattern that a structured difference could hide
    in)."""
    g = torch.Generator().manual_seed(zlib.crc32(tensor.encode()))
    return torch.randn(n, generator=g).to(device)


def rows_agree(
    grad: torch.Tensor, a: torch.Tensor, e: torch.Tensor, probe: torch.Tensor
) -> torch.Tensor:
    """Whether ``e.T @ a`` (a k x N, e k x M) is `grad` (M x N) to rounding, as a float32
    tensor of one element on their device (1: agree; read once the step's copies are waited
    for, so no synchronize of its own): ``grad @ v`` against ``e.T @ (a @ v)`` for the fixed
    random `probe` v. A difference D of the two matrices with ``D @ v`` within rounding for a
    random normal v is one whose effect is itself within rounding. The bound: the two sides'
    own rounding, from the magnitude ``|e|.T @ (|a| @ |v|)``, at the precision of the lowest of
    the dtypes (bfloat16 under autocast). Cost: one pass over `grad` (``grad @ v``)."""
    g, a32, e32 = grad.detach().float(), a.float(), e.float()
    av = probe.abs()
    diff = (g @ probe - e32.T @ (a32 @ probe)).abs()
    eps = max(torch.finfo(t.dtype).eps for t in (grad, a, e))
    eps32 = torch.finfo(torch.float32).eps
    k = a.shape[0]
    # |e|.T @ |a| bounds |grad| elementwise where the two agree: no |grad| (an M x N copy)
    bound = (4 * eps + 8 * math.sqrt(k + a.shape[1]) * eps32) * (e32.abs().T @ (a32.abs() @ av))
    return (diff <= bound).all().float().reshape(1)
