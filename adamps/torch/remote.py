"""A PyTorch model's parameters on the parameter servers: check, create, pull, push.

Everything goes through the one ``PSClient`` (routing, retries, the data plane, exactly-once
``(client, seq)`` pushes), so a torch replica reaches the servers' state by the same
validate -> lease -> replicate -> apply path as the numpy trainer.

Creation is all or nothing from the model's side: every server is asked which tensors it holds
(``list``) before anything is created, and a tensor of this run that exists with another shape
stops the run with its name and both shapes, having created nothing. Tensors that exist with the
right shape are a run being resumed (a restarted replica 0): they are kept, not re-initialised.
A run created before placement groups (adamps/torch/params.py) holds its parameters under their
plain names: ``adopt_plain_names`` finds them and keeps them (that run stays ungrouped).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from adamps.client import (
    ControllerRouting,
    PSClient,
    StaticRouting,
    routing_from_table,
)
from adamps.client.rpc import RpcError, SyncRpc, get_json
from adamps.layout import Layout, TensorSpec, group_of, ungrouped
from adamps.optspec import KINDS, OptimError, Optimizer, spec_of
from adamps.torch.params import ModelError, Param
from adamps.torch.staging import HostStage

log = logging.getLogger(__name__)

#: the servers' optimizers (adamps.optspec: torch.optim's names, and the old Adagrad)
OPTIMIZERS = KINDS


def server_shape(p: Param) -> tuple[int, ...]:
    """A 0-dim parameter is a tensor of one element on the servers."""
    return p.shape or (1,)


def host_values(p: Param) -> np.ndarray:
    """A float32 host copy of the parameter's values, in its server shape (from any device)."""
    t = p.param.detach().to("cpu", torch.float32).reshape(server_shape(p))
    return np.array(t.numpy(), dtype=np.float32, copy=True)


def optimizer_spec(
    kind: str,
    lr: float,
    adagrad_initial: float = 0.0,
    args: Mapping[str, Any] | None = None,
    table: bool = False,
) -> dict[str, Any]:
    """The servers' optimizer definition for a model's tensors (or a table's rows): `kind`
    (torch.optim's name: sgd, adagrad, adam, adamw, rmsprop; rowwise_adagrad and sparse_adam for tables;
    adagrad_legacy) at `lr`, its other hyperparameters in `args` (torch's names and defaults).
    A bad one is a ModelError naming it, before anything is created."""
    if float(lr) < 0:  # torch.optim's rule; the servers' sgd takes any lr (the board's -1)
        raise ModelError(f"{kind} lr must be >= 0 (as torch.optim), got {lr}")
    try:
        spec = spec_of(kind, float(lr), float(adagrad_initial), args)
        opt = Optimizer.from_dict(spec)
        opt.check_for_table() if table else opt.check_for_tensor()
    except OptimError as exc:
        raise ModelError(str(exc)) from None
    return spec


class RemoteModel:
    """The servers' copy of a list of :class:`Param`. Thread-safe (``PSClient`` is)."""

    def __init__(
        self,
        params: Sequence[Param],
        *,
        controllers: Sequence[str] = (),
        ps: Sequence[str] = (),
        token: str | None = None,
        http_only: bool = False,
        retry_for: float = 60.0,
    ) -> None:
        if not controllers and not ps:
            raise ModelError("give the controllers (controllers=[...]) or the servers (ps=[...])")
        self.params = list(params)
        self.by_tensor = {p.tensor: p for p in self.params}
        specs = [p.spec() for p in self.params]
        specs = [type(s)(s.name, server_shape(p)) for s, p in zip(specs, self.params, strict=True)]
        routing: Any
        if controllers:
            table = _first_answer(controllers, "/routing")
            # the shard size is the servers' (they cut tensors themselves): ask one of them
            servers = routing_from_table(table).servers()
            status = _first_answer(servers, "/status") if servers else {}
            max_elems = int(status.get("config", {}).get("max_shard_elems", 262_144))
            layout = Layout(specs, int(table["n_buckets"]), max_elems)
            routing = ControllerRouting(controllers)
        else:
            status = get_json(ps[0], "/status")
            max_elems = int(status.get("config", {}).get("max_shard_elems", 262_144))
            layout = Layout(specs, int(status["n_buckets"]), max_elems)
            routing = StaticRouting(ps, int(status["n_buckets"]))
        self.layout = layout
        self.client = PSClient(
            routing, layout, token, retry_for=retry_for, data_plane=not http_only
        )
        #: tensor -> the optimizer hyperparameters its pushes name (a torch optimizer's param
        #: groups, as a scheduler leaves them: server_optim.py); absent: the tensor's own
        self.hyper: dict[str, dict[str, Any]] = {}
        #: the lr of a tensor not in `hyper` (the one it was created with): what a push's
        #: ``lr_scale`` scales (Connection sets it)
        self.lr: float | None = None
        #: tensors whose pushes ``lr_scale`` leaves alone (plain SGD's: core/staleness.divides)
        self.unscaled: set[str] = set()

    # -- definition ------------------------------------------------------------------------------

    def existing(self, names: set[str] | None = None) -> dict[str, tuple[int, ...]]:
        """The shapes of this model's tensors (or of `names`) that some server already holds."""
        names = set(self.by_tensor) if names is None else names
        found: dict[str, tuple[int, ...]] = {}
        for url in self.client.routing(refresh=True).servers():
            rpc = SyncRpc(url, self.client.token, self.client.timeout)
            try:
                tensors = rpc.call("list")["tensors"]
            finally:
                rpc.close()
            for t in tensors:
                if t["name"] in names:
                    found[t["name"]] = tuple(t["shape"])
        return found

    def adopt_plain_names(self) -> list[Param]:
        """The model's params, renamed to their plain names (no placement group) when the
        servers hold this run's parameters under those and none under the grouped ones: a run
        created before placement groups existed, resumed by this version, keeps its tensors
        (and their buckets, checkpoints and optimizer state) instead of starting new ones."""
        if not any(group_of(p.tensor) for p in self.params):
            return self.params
        plain = {ungrouped(p.tensor) for p in self.params}
        found = self.existing(plain | set(self.by_tensor))
        if any(t in found for t in self.by_tensor) or not plain & set(found):
            return self.params
        log.info("this run's tensors exist under their plain names: kept, not grouped")
        self.params = [Param(p.name, ungrouped(p.tensor), p.param) for p in self.params]
        self.by_tensor = {p.tensor: p for p in self.params}
        specs = [TensorSpec(p.tensor, server_shape(p)) for p in self.params]
        self.layout = Layout(specs, self.layout.n_buckets, self.layout.max_shard_elems)
        self.client.layout = self.layout
        return self.params

    def check(self) -> dict[str, tuple[int, ...]]:
        """Raises ModelError naming every tensor held on the servers with another shape."""
        found = self.existing()
        wrong = [
            f"{p.tensor!r} (parameter {p.name!r}) is {list(found[p.tensor])} on the servers, "
            f"{list(server_shape(p))} in the model"
            for p in self.params
            if p.tensor in found and found[p.tensor] != server_shape(p)
        ]
        if wrong:
            raise ModelError(
                "tensors already on the servers have other shapes (another model in this run? "
                "give another --run): " + "; ".join(wrong)
            )
        return found

    def create(
        self,
        optimizer: Mapping[str, Any],
        per_tensor: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> list[str]:
        """Creates the tensors the servers do not hold yet, with the model's current values and
        `optimizer` (or the tensor's own in `per_tensor`: a param group's); returns their names.
        Checks every tensor first: a conflict creates nothing."""
        found = self.check()
        made = []
        for p in self.params:
            if p.tensor in found:
                continue
            values = host_values(p)
            self.client.create(
                p.spec().__class__(p.tensor, server_shape(p)),
                init={"kind": "values", "values": values},
                optimizer=dict((per_tensor or {}).get(p.tensor, optimizer)),
            )
            made.append(p.tensor)
        if found:
            log.info("%d tensors of this run exist on the servers: resumed", len(found))
        return made

    # -- values ------------------------------------------------------------------------------------

    def pull(
        self,
        params: Sequence[Param] | None = None,
        stage: HostStage | None = None,
        residuals: Mapping[str, np.ndarray] | None = None,
    ) -> dict[str, list[int]]:
        """Copies the servers' values into the parameters (in place): straight into a float32
        CPU parameter's memory, else through `stage`'s host buffers (adamps/torch/staging.py)
        and one ``non_blocking`` copy per parameter. `residuals` (server tensor -> flat float32
        array) are added to the values on the host before they reach the parameters. Returns
        the shards' versions (tensor -> per shard: the updates each has applied)."""
        params = self.params if params is None else params
        stage = stage if stage is not None else HostStage()
        with torch.no_grad():
            out = stage.value_buffers(params)
            _, versions = self.client.pull([p.tensor for p in params], out=out)
            for tensor, r in (residuals or {}).items():
                out[tensor].reshape(-1)[:] += r
            stage.to_device(params)
        return versions

    def values(self) -> dict[str, np.ndarray]:
        """The servers' values, by parameter name (not written into the model)."""
        got, _ = self.client.pull([p.tensor for p in self.params])
        return {p.name: got[p.tensor].reshape(p.shape) for p in self.params}

    def push(
        self,
        parts: Sequence[tuple[Any, ...]],
        rows: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
        fetch: tuple[Sequence[Param], HostStage, Mapping[str, np.ndarray], dict[str, list[int]]]
        | None = None,
        lr_scale: float = 1.0,
    ) -> int:
        """Sends a push's parts in gradient units: ``("fc", t, a, e)``, ``("dense", t, g)``,
        ``("compressed", t, Encoded)`` (adamps/compression/error_feedback.py's forms), and embedding tables'
        `rows` (server table -> (ids, grads)): the fc vectors, dense gradients, compressed
        updates and rows in one exactly-once round, one request per server (``PSClient.round``). Every part is checked before any is sent (issue 39: a
        NaN anywhere refuses the whole push, nothing applied). `fetch` (params, stage,
        residuals, versions), as ``pull``'s: the same round also answers those parameters'
        values, read after its writes, installed as ``pull`` installs them (one request per
        server for the step's push and fetch), and fills `versions` as ``pull`` returns them.
        `lr_scale` (a stale push's, adamps/core/staleness.py) scales the lr its tensors are
        applied with. Returns the array payload bytes sent."""
        fc: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        dense: dict[str, np.ndarray] = {}
        compressed: dict[str, Any] = {}
        nbytes = 0
        for kind, name, *arrays in parts:
            if kind == "fc":
                fc[name] = (arrays[0], arrays[1])
                nbytes += arrays[0].nbytes + arrays[1].nbytes
            elif kind == "compressed":
                compressed.update(arrays[0].shards)
                nbytes += arrays[0].nbytes
            else:
                g = arrays[0].reshape(self.layout.tensors[name].shape)
                dense[name] = g
                nbytes += g.nbytes
        hyper = self.hyper
        if lr_scale != 1.0:
            named = (*fc, *dense, *self._tensors_of(compressed))
            hyper = {
                t: h
                for t in named
                if (h := self.hyper.get(t) if t in self.unscaled else self._scaled(t, lr_scale))
            }
        if fetch is not None:
            params, stage, residuals, versions = fetch
            with torch.no_grad():
                out = stage.value_buffers(params)
                self.client.round(
                    fc, dense, rows=rows, compressed=compressed, hyper=hyper, fetch=out,
                    fetch_versions=versions,
                )  # fmt: skip
                for tensor, r in residuals.items():
                    out[tensor].reshape(-1)[:] += r
                stage.to_device(params)
        elif fc or dense or rows or compressed:  # one request per server (adamps/client/round.py)
            self.client.round(fc, dense, rows=rows, compressed=compressed, hyper=hyper)
        return nbytes

    def _scaled(self, tensor: str, scale: float) -> dict[str, Any]:
        """The hyperparameters of `tensor`'s updates with its lr scaled by `scale`."""
        h = dict(self.hyper.get(tensor, {}))
        lr = h.get("lr", self.lr)
        if lr is not None:
            h["lr"] = float(lr) * scale
        return h

    def _tensors_of(self, compressed: Mapping[str, Any]) -> set[str]:
        return {self.layout.shards[sid].tensor for sid in compressed}

    def close(self) -> None:
        self.client.close()


def _first_answer(urls: Sequence[str], path: str) -> Any:
    errors = []
    for url in urls:
        try:
            return get_json(url, path)
        except (OSError, RpcError, ValueError) as exc:
            errors.append(f"{url}: {exc}")
    raise ConnectionError(f"none of {list(urls)} answered {path}: " + "; ".join(errors))
