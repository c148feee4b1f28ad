"""The optimizer hyperparameters a push names for its updates (field ``hyper``): how a torch LR
scheduler's lr (and betas, momentum) reaches the servers.

A tensor's optimizer is fixed when it is created: its kind and the layout of its state (Adam's
``amsgrad``, RMSprop's ``centered``, whether SGD or RMSprop keep a momentum buffer). Its
hyperparameters may change afterwards, as ``group["lr"]`` changes under a scheduler: a
``round`` (or ``push_fc``, ``push_compressed``) may carry ``hyper``, a map of tensor name ->
hyperparameters (torch's names: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum``,
...; those not named keep the tensor's definition). Each of the push's updates of that tensor is
applied with them, and carries them in its replicated form (``"o"``: every copy applies the
same update with the same rule; adamps/server/replication/wire.py). So the hyperparameters are part of the write
itself: validated with it, deduplicated with it by (client, seq), replicated with it over
two-phase commit. Nothing about them is kept between pushes, so a failover, a restart, a state
transfer or a checkpoint restore loses nothing: the next push names them again.

Pure: no IO. The check is the create's (adamps.optspec, bounds.check_optimizer) plus: the kind
and the state's layout must stay the tensor's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from adamps.server.updates import bounds
from adamps.server.updates.optim import OptimError, Optimizer
from adamps.wire.protocol import ProtocolError

#: most tensors one push's ``hyper`` may name
MAX_TENSORS = 4096
#: the fields that fix a state's layout: they may not change after create
LAYOUT = ("amsgrad", "centered", "nesterov")


#: (tensor, id of its optimizer, the hyper's items) -> (that optimizer, the checked result):
#: every push of a step names the same values, checked once (35 us each here) until they change
_CHECKED: dict[tuple[Any, ...], tuple[Optimizer, Optimizer]] = {}
_CHECKED_MAX = 4096


def with_hyper(base: Optimizer, d: Any, name: str) -> Optimizer:
    """`base` (a tensor's optimizer) with the hyperparameters of `d` (torch's names; ``kind``
    may be given and must be base's). Raises ProtocolError bad_request naming the problem."""
    if (type(d) is not dict and not isinstance(d, Mapping)) or not all(
        isinstance(k, str) for k in d
    ):
        raise ProtocolError("bad_request", f"hyper of {name!r} must map field names to values")
    try:
        # the items in the sender's order (the same every push): no sort per tensor per push
        key = (name, id(base), tuple(d.items()))
        hit = _CHECKED.get(key)
    except TypeError:  # a list value (betas): frozen, in a canonical order
        try:
            key = (name, id(base), tuple(sorted((k, _frozen(v)) for k, v in d.items())))
            hit = _CHECKED.get(key)
        except TypeError:  # a value that is not hashable: checked (and refused) below
            key, hit = None, None
    if hit is not None and hit[0] is base:  # the very optimizer (an id is reused after a drop)
        return hit[1]
    opt = _checked(base, d, name)
    if key is not None:
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[key] = (base, opt)
    return opt


def _frozen(v: Any) -> Any:
    return tuple(v) if isinstance(v, list | tuple) else v


def _checked(base: Optimizer, d: Mapping[str, Any], name: str) -> Optimizer:
    rest = dict(d)
    kind = rest.pop("kind", base.kind)
    if kind != base.kind:
        raise ProtocolError(
            "bad_request",
            f"hyper of {name!r} names optimizer {kind!r}; the tensor's is {base.kind!r} "
            "(the kind is fixed when the tensor is created)",
        )
    lr = rest.pop("lr", base.lr)
    try:
        opt = Optimizer(base.kind, lr, {**base.params, **rest})
    except OptimError as exc:
        raise ProtocolError("bad_request", f"hyper of {name!r}: {exc}") from None
    changed = [f for f in LAYOUT if f in base.params and opt.params[f] != base.params[f]]
    if changed or opt.slots != base.slots:
        what = changed or ["momentum (zero and non-zero keep different state)"]
        raise ProtocolError(
            "bad_request",
            f"hyper of {name!r} changes {', '.join(what)}: that fixes the layout of the "
            "tensor's optimizer state when it is created",
        )
    try:
        bounds.check_optimizer(opt)
    except ProtocolError as exc:
        raise ProtocolError(exc.code, f"hyper of {name!r}: {exc.message}") from None
    return opt


def push_hyper(
    msg: Mapping[str, Any], tensors: Mapping[str, Any]
) -> dict[str, tuple[Optimizer, dict[str, Any]]]:
    """A push's ``hyper`` checked whole: tensor name -> (the optimizer its updates in this push
    use, its wire form for the replicated updates). `tensors`: the store's (name -> TensorState).
    Every name must be a tensor defined here."""
    raw = msg.get("hyper")
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise ProtocolError("bad_request", "field 'hyper' must map tensor names to maps")
    if len(raw) > MAX_TENSORS:
        raise ProtocolError(
            "too_large", f"field 'hyper' names {len(raw)} tensors; the limit is {MAX_TENSORS}"
        )
    out: dict[str, tuple[Optimizer, dict[str, Any]]] = {}
    for name, d in raw.items():
        t = tensors.get(name) if isinstance(name, str) else None
        if t is None:
            raise ProtocolError("unknown_tensor", f"hyper names {name!r}: no such tensor here")
        opt = with_hyper(t.optimizer, d, name)
        out[name] = (opt, opt.to_dict())
    return out


def of_update(base: Optimizer, u: Mapping[str, Any], name: str) -> Optimizer | None:
    """The optimizer a replicated update names (``"o"``), checked against its tensor's, or None
    (the tensor's own)."""
    o = u.get("o")
    return None if o is None else with_hyper(base, o, name)
