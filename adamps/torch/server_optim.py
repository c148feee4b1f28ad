"""torch.optim optimizers whose update rule runs on the parameter servers.

    model = Net()
    opt = adamps.torch.AdamW(
        [{"params": model.body.parameters()},
         {"params": model.head.parameters(), "lr": 3e-3, "weight_decay": 0.0}],
        model=model, lr=1e-3,
    )
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=1000)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # the gradients to the servers, their AdamW step, the new values back
        sched.step()        # group["lr"] changes: the servers use it from the next step's updates
    opt.close()

Each class is a ``torch.optim.Optimizer`` (``param_groups``, ``defaults``, ``zero_grad``,
``step(closure)``, ``state_dict``/``load_state_dict``, hooks), named and defaulted as the
torch.optim class the servers apply: :class:`SGD`, :class:`Adagrad`, :class:`Adam`,
:class:`AdamW`, :class:`RMSprop`; :class:`DownpourOptimizer` takes the kind as a string (the
original entry point, model first). ``model=`` names the parameters (the server tensors are
``RUN..NAME``) and carries the act/err hooks; a module given as ``params`` is both.

One rule per param group, applied on the servers. Each tensor is created with its group's
optimizer (kind and hyperparameters). Every push then names its tensors' hyperparameters as the
groups hold them at that step (``hyper`` of the round: adamps/server/updates/hyper.py), so whatever
changes ``group["lr"]`` (an LR scheduler; OneCycleLR's betas or momentum too; a hand-written
decay) changes the servers' rule from the next step's updates, with no extra request: the
hyperparameters are part of the replicated, deduplicated write. What fixes the layout of the
servers' state (the kind, ``amsgrad``, ``centered``, ``nesterov``, a zero or non-zero momentum)
may not change after creation: a group that changes it raises ModelError at ``step()``.

``state_dict()`` is torch's layout (``state``, ``param_groups`` with every hyperparameter and
the schedulers' keys) plus ``adamps``: the kind, the run, the server tensors in parameter order
and the step count. The optimizer's state (Adam's moments, Adagrad's sums, step counts) stays on
the servers, replicated and checkpointed with the values: a resumed run reattaches to it by its
run name (the same ``run``, ``create`` finds the tensors and keeps them), or gets it back from
``adamps checkpoint restore``. ``load_state_dict`` restores the groups' hyperparameters and the
step count, and refuses a state_dict of other tensors.

``GradScaler`` (torch.amp): these optimizers take the scaler's ``grad_scale`` and ``found_inf``
(``_step_supports_amp_scaling``): a step whose gradients hold an inf or NaN is skipped (nothing
pushed, nothing changed; the scaler backs off), otherwise the gradients are unscaled in place
before they are checked and pushed. Linear layers then push their unscaled ``.grad``, not
activation/error rows (those are scaled). Tables (adamps Embedding) under a GradScaler: refused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, ClassVar

import torch
from torch import nn

from adamps.layout import ungrouped
from adamps.optspec import FIELDS, OptimError, Optimizer
from adamps.torch.downpour import PushCounts, replica_stats
from adamps.torch.optimizer import Connection
from adamps.torch.params import ModelError
from adamps.torch.remote import optimizer_spec

#: the fields that fix the layout of the servers' optimizer state (adamps/server/updates/hyper.py)
LAYOUT = ("amsgrad", "centered", "nesterov")


def group_hyper(kind: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters of `kind` as plain data (torch's names): what a push
    names for the group's tensors. Tensors (a tensor lr) become numbers."""
    out: dict[str, Any] = {}
    for name, default in FIELDS[kind].items():
        v = group.get(name, default)
        if name == "betas":
            if not isinstance(v, list | tuple) or len(v) != 2:
                raise ModelError(f"{kind} betas must be two numbers, got {v!r}")
            v = [_number(kind, name, b) for b in v]
        elif not isinstance(v, bool):
            v = _number(kind, name, v)
        out[name] = v
    return out


def _number(kind: str, name: str, v: Any) -> float:
    """A hyperparameter as a float: a number or a 1-element tensor (a tensor lr), as torch
    takes them; a string or None is refused naming it (float() would take "0.9" silently)."""
    if v is None or isinstance(v, str | bytes):
        raise ModelError(f"{kind} {name} must be a number, got {v!r}")
    try:
        return float(v)
    except (TypeError, ValueError, RuntimeError):
        raise ModelError(f"{kind} {name} must be a number, got {v!r}") from None


def kind_of(optimizer: Any) -> str:
    """A server optimizer's kind from its name (``"adamw"``) or a torch.optim class
    (``torch.optim.AdamW``)."""
    name = optimizer.__name__ if isinstance(optimizer, type) else optimizer
    kind = str(name).lower()
    if kind not in FIELDS:
        raise ModelError(f"optimizer must be one of {sorted(FIELDS)} (or its torch.optim class)")
    return kind


#: torch.optim's arguments that choose its implementation, not the rule, and their values that
#: leave the rule as it is: a script ported with ``fused=True`` or ``foreach=True`` keeps them
#: (the servers' kernels apply the rule), one that asks for another rule is refused
IMPLEMENTATION = {"foreach": None, "fused": None, "capturable": False, "differentiable": False,
                  "maximize": False}  # fmt: skip


def _implementation_flags(name: str, hyper: dict[str, Any]) -> None:
    """Takes torch.optim's implementation flags out of `hyper`; ModelError for a value the
    servers cannot honour."""
    for flag in [k for k in hyper if k in IMPLEMENTATION]:
        value = hyper.pop(flag)
        if flag in ("foreach", "fused"):
            if value not in (None, True, False):
                raise ModelError(f"{name}: {flag} must be None, True or False, got {value!r}")
        elif value not in (False, None):
            why = (
                "the servers' rules descend: minimize the negated loss instead"
                if flag == "maximize"
                else "the update runs on the servers, outside autograd and CUDA graphs"
            )
            raise ModelError(f"{name}: {flag}={value!r} is not supported ({why})")


class ServerOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` whose rule the servers apply (module docstring). Keyword
    arguments besides the hyperparameters: the cluster (``controllers``, ``ps``, ``run``,
    ``token``: by default from ``adamps launch`` or the cluster file), ``create`` (replica 0's
    job), ``act_err``, ``http_only``, Downpour's ``n_push``/``n_fetch``/``local_lr``,
    ``compress`` and ``staleness`` ("auto": a push's lr divided by 1 + its measured staleness,
    except plain SGD's, adamps/core/staleness.py; "off"), ``fuse`` (small parameters in
    placement groups, the default; adamps/torch/params.py) (docs/training.md)."""

    #: the servers' optimizer (adamps.optspec's kinds: torch.optim's names)
    kind: ClassVar[str] = "sgd"
    #: GradScaler hands this optimizer its scale and found_inf instead of unscaling (step())
    _step_supports_amp_scaling = True

    def __init__(
        self,
        params: Any,
        *,
        model: nn.Module | None = None,
        controllers: Sequence[str] = (),
        ps: Sequence[str] = (),
        run: str | None = None,
        token: str | None = None,
        create: bool = True,
        act_err: bool = True,
        http_only: bool = False,
        n_push: int = 1,
        n_fetch: int = 1,
        local_lr: float | None = None,
        compress: Any = False,
        staleness: str = "auto",
        fuse: bool = True,
        **hyper: Any,
    ) -> None:
        if isinstance(params, nn.Module):
            model = params if model is None else model
            params = params.parameters()
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"{type(self).__name__} needs model=: the module whose parameters it trains "
                "(their names are the server tensors' names)"
            )
        fields = FIELDS[self.kind]
        _implementation_flags(type(self).__name__, hyper)
        unknown = sorted(set(hyper) - set(fields))
        if unknown:
            raise TypeError(
                f"{type(self).__name__} got unknown hyperparameter(s) {unknown}; "
                f"it takes {sorted(fields)}"
            )
        self._ready = False
        super().__init__(params, {**fields, **hyper})
        names = {id(p): n for n, p in model.named_parameters()}
        named: list[tuple[str, Any]] = []
        specs: dict[str, dict[str, Any]] = {}
        for i, g in enumerate(self.param_groups):
            spec = self._spec(g, i)
            for p in g["params"]:
                n = names.get(id(p))
                if n is None:
                    raise ModelError(
                        f"param group {i} holds a parameter of shape {list(p.shape)} that is "
                        "not one of model's: give model= the module that owns every parameter"
                    )
                named.append((n, p))
                specs[n] = spec
        #: each group's optimizer as created: what its hyperparameters may not change
        self._created = [
            Optimizer.from_dict(self._spec(g, i)) for i, g in enumerate(self.param_groups)
        ]
        first = self.param_groups[0]
        self.conn = Connection(
            model, controllers=controllers, ps=ps, run=run, token=token, lr=first["lr"],
            optimizer=self.kind, optimizer_args=_args(self.kind, first), create=create,
            act_err=act_err, http_only=http_only, named_parameters=named, specs=specs,
            fuse=fuse,
        )  # fmt: skip
        self.model = model
        self._tensor = {id(p.param): p.tensor for p in self.conn.params}
        try:
            self.worker = self.conn.worker(
                local_lr=float(first["lr"]) if local_lr is None else local_lr,
                n_push=n_push, n_fetch=n_fetch, compress=compress, staleness=staleness,
            )  # fmt: skip
        except BaseException:
            self.conn.close()
            raise
        #: steps taken (pushed; a step skipped by a GradScaler is not one)
        self.steps = 0
        #: steps a GradScaler skipped (an inf or NaN in the scaled gradients)
        self.skipped = 0
        #: per group, the hyperparameters last checked (a change is checked once)
        self._last: list[dict[str, Any] | None] = [None] * len(self.param_groups)
        self._ready = True

    # -- torch.optim.Optimizer ------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_ready", False):
            raise ModelError(
                f"{type(self).__name__} takes its param groups when it is made: their "
                "parameters are server tensors created then"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's, plus what the step would otherwise push from the passes before it: the
        linear layers' activation/error rows and the embedding tables' row gradients."""
        super().zero_grad(set_to_none=set_to_none)
        if self.conn.capture is not None:
            self.conn.capture.discard()
        for t in self.conn.tables:
            t.take_grads()

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Checks every gradient, then pushes it with the groups' current hyperparameters,
        steps locally and fetches on schedule (Downpour: adamps/torch/downpour.py); a NaN or
        Inf raises ``RpcError("non_finite")`` with nothing changed (under a GradScaler: the
        step is skipped)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None and not self._amp_ready(found_inf):
            return loss
        self.conn.remote.hyper = self._hyper()
        self.worker.step({p.tensor: p.param.grad for p in self.conn.params})
        self.steps += 1
        return loss

    def _amp_ready(self, found_inf: Any) -> bool:
        """Under a GradScaler: False (the step is skipped) when its gradients hold an inf or
        NaN, else unscales them in place; the linear layers' rows (scaled) are dropped so that
        their unscaled ``.grad`` is pushed."""
        if self.conn.tables:
            raise ModelError("a GradScaler with adamps Embedding tables is not supported")
        if self.conn.capture is not None:
            self.conn.capture.discard()
        if float(found_inf) > 0:
            self.skipped += 1
            return False
        scale = getattr(self, "grad_scale", None)
        if scale is not None:
            inv = 1.0 / float(scale)
            with torch.no_grad():
                for p in self.conn.params:
                    if p.param.grad is not None:
                        p.param.grad.mul_(inv)
        return True

    def _spec(self, group: Mapping[str, Any], i: int) -> dict[str, Any]:
        try:
            h = group_hyper(self.kind, group)
            args = {k: v for k, v in h.items() if k != "lr"}
            return optimizer_spec(self.kind, h["lr"], 0.0, args)
        except (ModelError, TypeError, ValueError) as exc:
            raise ModelError(f"param group {i}: {exc}") from None

    def _hyper(self) -> dict[str, dict[str, Any]]:
        """Tensor -> its group's hyperparameters now; a group's change is checked once: what
        fixes the servers' state layout may not change (ModelError naming it)."""
        out: dict[str, dict[str, Any]] = {}
        for i, g in enumerate(self.param_groups):
            h = group_hyper(self.kind, g)
            if h != self._last[i]:
                self._check_change(i, g)
                self._last[i] = h
            for p in g["params"]:
                out[self._tensor[id(p)]] = h
        return out

    def _check_change(self, i: int, group: Mapping[str, Any]) -> None:
        try:
            now = Optimizer.from_dict(self._spec(group, i))
        except OptimError as exc:
            raise ModelError(f"param group {i}: {exc}") from None
        was = self._created[i]
        changed = [f for f in LAYOUT if f in was.params and now.params[f] != was.params[f]]
        if changed or now.slots != was.slots:
            what = ", ".join(changed) or "momentum (zero and non-zero keep different state)"
            raise ModelError(
                f"param group {i} changed {what}: that fixes the layout of the servers' "
                "optimizer state when the tensors are created"
            )

    def state_dict(self) -> dict[str, Any]:
        """torch's (``state``, ``param_groups``) and ``adamps``: kind, run, tensors, steps."""
        sd = super().state_dict()
        sd["adamps"] = {"kind": self.kind, "tensors": self.tensors(), "steps": self.steps}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restores the groups' hyperparameters and the step count (the servers hold the rest:
        module docstring); refuses a state_dict of another kind or of other tensors."""
        extra = state_dict.get("adamps")
        if not isinstance(extra, Mapping):
            raise ValueError("not an adamps.torch optimizer's state_dict (no 'adamps' entry)")
        if extra.get("kind") != self.kind:
            raise ValueError(
                f"a state_dict of a {extra.get('kind')!r} optimizer, not {self.kind!r}"
            )
        # compared without placement groups: the same parameters of a run made before groups
        if [ungrouped(t) for t in extra.get("tensors", [])] != [
            ungrouped(t) for t in self.tensors()
        ]:
            raise ValueError(
                f"the state_dict is of the server tensors {list(extra.get('tensors', []))[:4]}..., "
                f"this optimizer's are {self.tensors()[:4]}... (another model or run?)"
            )
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "adamps"})
        self._last = [None] * len(self.param_groups)  # checked again at the next step
        self.steps = int(extra.get("steps", 0))

    # -- adamps ---------------------------------------------------------------------------------

    def tensors(self) -> list[str]:
        """The server tensors of the groups' parameters, in order."""
        return [self._tensor[id(p)] for g in self.param_groups for p in g["params"]]

    @property
    def counts(self) -> PushCounts:
        return self.conn.counts

    def flush(self) -> None:
        """Pushes what accumulated since the last push and fetches the servers' values."""
        self.worker.flush()
        self.worker.fetch()
        self.worker.flush()

    def stats(self) -> dict[str, Any]:
        """Pushes, fetches, bytes pushed, the client's retries and the failovers it rode through
        (``failovers``: how many; ``last_failover``: bucket, old and new primary, seconds
        stalled; each is also logged once, as a warning of the logger ``adamps.client``)."""
        return replica_stats(self.conn.counts, self.conn.remote.client)

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict at the servers' parameter values (buffers: this replica's)."""
        return self.conn.server_state_dict()

    def close(self) -> None:
        """Pushes what is left (waiting for the acknowledgement) and closes the connections."""
        try:
            self.worker.close()
        finally:
            self.conn.close()

    def __enter__(self) -> ServerOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _args(kind: str, group: Mapping[str, Any]) -> dict[str, Any]:
    """A group's hyperparameters but lr (optimizer_spec's `args`)."""
    return {k: v for k, v in group_hyper(kind, group).items() if k != "lr"}


class SGD(ServerOptimizer):
    """torch.optim.SGD on the servers (lr, momentum, dampening, nesterov, weight_decay)."""

    kind = "sgd"


class Adagrad(ServerOptimizer):
    """torch.optim.Adagrad on the servers (lr, lr_decay, weight_decay,
    initial_accumulator_value, eps)."""

    kind = "adagrad"


class Adam(ServerOptimizer):
    """torch.optim.Adam on the servers (lr, betas, eps, weight_decay, amsgrad)."""

    kind = "adam"


class AdamW(ServerOptimizer):
    """torch.optim.AdamW on the servers (lr, betas, eps, weight_decay, amsgrad)."""

    kind = "adamw"


class RMSprop(ServerOptimizer):
    """torch.optim.RMSprop on the servers (lr, alpha, eps, weight_decay, momentum, centered)."""

    kind = "rmsprop"


class DownpourOptimizer(ServerOptimizer):
    """The original entry point, model first, the servers' rule by name: ``optimizer`` (sgd,
    adagrad, adam, adamw, rmsprop, adagrad_legacy, or the torch.optim class) at ``lr``, its
    other hyperparameters in ``optimizer_args`` (torch's names and defaults); local steps at
    ``local_lr`` (default ``lr``); ``compress``: Strom's compression (True, or Compressor
    options); ``fuse``: small parameters in placement groups (the default). One param group:
    the model's parameters."""

    def __init__(
        self,
        model: nn.Module,
        *,
        controllers: Sequence[str] = (),
        ps: Sequence[str] = (),
        lr: float = 0.01,
        optimizer: Any = "sgd",
        local_lr: float | None = None,
        n_push: int = 1,
        n_fetch: int = 1,
        run: str | None = None,
        token: str | None = None,
        compress: Any = False,
        create: bool = True,
        act_err: bool = True,
        adagrad_initial: float = 0.0,
        optimizer_args: Mapping[str, Any] | None = None,
        http_only: bool = False,
        staleness: str = "auto",
        fuse: bool = True,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ModelError(
                f"expected a torch.nn.Module, got {type(model).__name__}: {model!r:.80}"
            )
        self.kind = kind_of(optimizer)  # type: ignore[misc]  # this instance's rule
        hyper = dict(optimizer_args or {})
        if self.kind == "adagrad":
            hyper.setdefault("initial_accumulator_value", adagrad_initial)
        elif self.kind == "adagrad_legacy":
            hyper.setdefault("initial_accumulator", adagrad_initial)
        super().__init__(
            _named_params(model), model=model, controllers=controllers, ps=ps, run=run,
            token=token, create=create, act_err=act_err, http_only=http_only, n_push=n_push,
            n_fetch=n_fetch, local_lr=lr if local_lr is None else local_lr, compress=compress,
            staleness=staleness, fuse=fuse, lr=lr, **hyper,
        )  # fmt: skip


def _named_params(model: nn.Module) -> Iterable[Any]:
    """The model's parameters as one group (an empty one for a model of adamps tables only:
    torch.optim refuses an empty list, Connection says whether the model has anything)."""
    return [p for _n, p in model.named_parameters()] or [{"params": []}]
