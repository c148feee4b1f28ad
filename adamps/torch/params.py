"""Which tensors of a ``torch.nn.Module`` live on the parameter servers, and under what names.

Pure: no IO, no servers. A model's parameters are server tensors named
``<run>..<parameter name>`` (``default..fc1.weight``): the run's namespace comes first, so two
runs on the same servers never share a tensor by accident. The separator ``..`` cannot occur in a
PyTorch parameter name (its parts are non-empty module and attribute names joined by single
dots), so the name splits back unambiguously at its last ``..`` whatever the run's name.

With ``fuse`` (what ``Connection`` asks), the model's small parameters are packed into
placement groups of at most one shard's elements (adamps/layout.py ``pack_groups``, first fit in
the parameters' order, so every replica and every restart derives the same names): a grouped
parameter's tensor is ``<run>..{<group>}<parameter name>`` (``default..{0}fc1.bias``), and all
tensors of a group share one bucket, so a small model's push round is a few bucket rounds, not
one per parameter (Horovod's tensor fusion, placed like Redis Cluster's hash tags). A parameter
larger than a shard keeps its plain name. :func:`split_name` gives back the parameter's own name
(the export and the state_dict files show it, tag removed).

Every problem is found here, before anything is created on the servers: a parameter whose dtype
float32 does not hold exactly (the servers hold float32: float32, bfloat16 and float16 train), one
on the meta device (no values), two parameters under one name, a name the layout refuses. Any
real device trains (adamps/torch/staging.py copies to and from it).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from adamps.layout import LayoutError, TensorSpec, grouped, pack_groups, ungrouped
from adamps.torch.staging import PARAM_DTYPES

SEP = ".."
DEFAULT_RUN = "default"
_RUN_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class ModelError(ValueError):
    """A model (or its parameters) that cannot train on the parameter servers; names the problem."""


@dataclass(frozen=True)
class Param:
    """One parameter and its server tensor."""

    name: str  #: the name in ``named_parameters()``
    tensor: str  #: the server tensor's name (run namespace included)
    param: nn.Parameter

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.param.shape)

    def spec(self) -> TensorSpec:
        """The server tensor: a 0-d parameter (a learned scale) is one element of shape (1,)."""
        return TensorSpec(self.tensor, self.shape or (1,))


def run_name(run: str | None) -> str:
    run = run or DEFAULT_RUN
    if not _RUN_RE.fullmatch(run):
        raise ModelError(f"run must be 1-64 letters, digits, '_', '.', '-', got {run!r}")
    return run


def tensor_name(run: str | None, param: str) -> str:
    """The server tensor of parameter `param` in run `run`."""
    return f"{run_name(run)}{SEP}{param}"


def split_name(tensor: str) -> tuple[str, str]:
    """(run, parameter name) of a tensor named by :func:`tensor_name` (a placement group's tag,
    ``RUN..{G}PARAM``, removed)."""
    run, sep, param = tensor.rpartition(SEP)
    param = ungrouped(param)
    if not sep or not run or not param or param.startswith("."):
        raise ValueError(f"{tensor!r} is not a run's tensor name (RUN..PARAM)")
    # 'a...b' is run 'a.' and param 'b': a parameter never starts with '.'
    return run, param


def model_params(
    model: Any,
    run: str | None = None,
    named: Iterable[tuple[str, Any]] | None = None,
    allow_empty: bool = False,
    fuse: bool = False,
) -> list[Param]:
    """The server tensors of `model` (``named_parameters()``, or the pairs `named`), checked.
    `allow_empty`: a model of embedding tables only (adamps.torch.Embedding) has none.
    `fuse`: small parameters in placement groups (module docstring)."""
    if not isinstance(model, nn.Module):
        raise ModelError(f"expected a torch.nn.Module, got {type(model).__name__}: {model!r:.80}")
    run = run_name(run)
    pairs: Sequence[tuple[str, Any]] = list(model.named_parameters() if named is None else named)
    if not pairs and not allow_empty:
        raise ModelError(f"{type(model).__name__} has no parameters to train")
    out: list[Param] = []
    seen: dict[str, str] = {}
    for name, p in pairs:
        if not isinstance(p, torch.Tensor):
            raise ModelError(f"parameter {name!r} is a {type(p).__name__}, not a tensor")
        if not p.is_floating_point():
            raise ModelError(
                f"parameter {name!r} has dtype {p.dtype}: only floating-point parameters can "
                "be trained (make it a buffer, or a float32 parameter)"
            )
        if p.dtype not in PARAM_DTYPES:
            raise ModelError(
                f"parameter {name!r} has dtype {p.dtype}: the servers hold float32, so a "
                "parameter is float32, bfloat16 or float16 (call model.float() first)"
            )
        if p.device.type == "meta":
            raise ModelError(
                f"parameter {name!r} is on the meta device (no values): move the model to a "
                "real device (model.to_empty(device=...) and initialise it) first"
            )
        t = tensor_name(run, name)
        if "{" in name or "}" in name:  # a brace would read as a placement group
            raise ModelError(
                f"parameter {name!r}: a name of letters, digits, '_', '.', '-' is expected"
            )
        if t in seen:
            raise ModelError(f"two parameters are named {name!r}: names must be unique")
        seen[t] = name
        try:
            TensorSpec(t, tuple(p.shape) if p.dim() else (1,))
        except LayoutError as exc:
            raise ModelError(f"parameter {name!r}: {exc}") from None
        out.append(Param(name, t, p))
    if fuse:
        groups = pack_groups([max(1, p.param.numel()) for p in out])
        ns = len(tensor_name(run, ""))
        out = [
            p if g is None else Param(p.name, grouped(p.tensor, str(g), ns), p.param)
            for p, g in zip(out, groups, strict=True)
        ]
    return out


def linear_weights(model: nn.Module, params: Sequence[Param]) -> dict[str, list[nn.Linear]]:
    """Server tensor -> the ``nn.Linear`` layers whose weight it is: the weights that may push
    activation and error vectors. A weight also held by a module that is not an ``nn.Linear``
    (e.g. tied to an embedding) is left out: its gradient has other terms than the layers'."""
    by_id = {id(p.param): p for p in params}
    holders: dict[str, list[nn.Module]] = {}
    for mod in model.modules():
        for attr, p in mod.named_parameters(recurse=False):
            if id(p) in by_id:
                holders.setdefault(by_id[id(p)].tensor, []).append(
                    mod if attr == "weight" else None
                )
    return {
        t: mods  # type: ignore[misc]
        for t, mods in holders.items()
        if all(isinstance(m, nn.Linear) for m in mods)
    }
