"""``DownpourOptimizer``: a ``torch.optim``-shaped handle on a model trained by the servers.

    model = Net()
    opt = adamps.torch.DownpourOptimizer(model, controllers=["127.0.0.1:7101"], lr=0.05)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()          # local step, push every n_push, fetch every n_fetch
    opt.close()             # pushes what is left

Construction checks the model (adamps/torch/params.py), the servers' tensors of the run (a
tensor of another shape: an error naming it, nothing created), creates the missing ones from the
model's values when ``create`` is true (replica 0's job; a resumed run keeps the servers'
values) and pulls the servers' values into the model: every replica starts from the same
weights. ``nn.Linear`` weights push activation/error rows captured by hooks: they are the raw
gradient of the loss, so give ``act_err=False`` when the loop changes gradients before
``step()`` (clipping, weight decay added to ``.grad``); every other parameter pushes ``.grad``.

Buffers (BatchNorm's running statistics) are not parameters: they stay in each replica's model
and are trained by its own forward passes; ``state_dict()`` of replica 0 is what the CLI exports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from adamps.torch import launch_env
from adamps.torch.downpour import PushCounts, WorkerDownpour, replica_stats
from adamps.torch.embedding import bind_tables, row_tables
from adamps.torch.hooks import ActErrCapture
from adamps.torch.params import Param, linear_weights, model_params
from adamps.torch.remote import RemoteModel, optimizer_spec


class Connection:
    """A model, its server tensors and the act/err hooks: what every worker of a replica shares."""

    def __init__(
        self,
        model: nn.Module,
        *,
        controllers: Sequence[str] = (),
        ps: Sequence[str] = (),
        run: str | None = None,
        token: str | None = None,
        lr: float = 0.01,
        optimizer: str = "sgd",
        adagrad_initial: float = 0.0,
        optimizer_args: Mapping[str, Any] | None = None,
        create: bool = True,
        act_err: bool = True,
        http_only: bool = False,
        named_parameters: Iterable[tuple[str, Any]] | None = None,
    ) -> None:
        # not given: from `adamps launch`'s environment or the cluster file (launch_env.py)
        controllers, run, token = launch_env.connection_defaults(controllers, ps, run, token)
        self.model = model
        #: the model's adamps Embedding / EmbeddingBag modules (rows on the servers' tables)
        self.tables = row_tables(model)
        self.params: list[Param] = model_params(
            model, run, named_parameters, allow_empty=bool(self.tables)
        )
        self.optimizer = optimizer_spec(optimizer, lr, adagrad_initial, optimizer_args)
        self.remote = RemoteModel(
            self.params, controllers=list(controllers), ps=list(ps), token=token,
            http_only=http_only,
        )  # fmt: skip
        self.created: list[str] = []
        try:
            if create:
                if controllers:  # GET /layout and `adamps status --run` show the run
                    launch_env.publish_layout(controllers, token, self.remote.layout, run)
                self.created = self.remote.create(self.optimizer)
            else:
                self.remote.check()
            # tables are created like tensors (idempotent): replica 0 creates, others check
            # (their row gradients are pushed by the step, checked with the others: defer)
            bind_tables(model, self.remote.client, run, create, defer=True)
        except BaseException:
            self.remote.close()
            raise
        self.capture = ActErrCapture(linear_weights(model, self.params)) if act_err else None
        self.counts = PushCounts()
        self.remote.pull()

    def worker(
        self,
        *,
        local_lr: float,
        n_push: int,
        n_fetch: int,
        compress: Any = None,
        asynchronous: bool = False,
        params: Sequence[Param] | None = None,
    ) -> WorkerDownpour:
        """The Downpour rule of one more worker (its own accumulators and compressor), stepping
        `params` (default: the model's; a Hogwild worker's own tensors on the same memory)."""
        comp = None
        if compress:
            from trainer.compress import Compressor

            opts = compress if isinstance(compress, dict) else {}
            comp = Compressor(self.remote.layout.shards_of, **opts)
        return WorkerDownpour(
            self.remote, self.params if params is None else params, self.capture, local_lr=local_lr, n_push=n_push,
            n_fetch=n_fetch, compressor=comp, counts=self.counts, asynchronous=asynchronous,
            tables=self.tables,
        )  # fmt: skip

    def server_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict with every parameter at the servers' value (buffers local)."""
        values = self.remote.values()
        out = {}
        for k, v in self.model.state_dict().items():
            out[k] = (  # the servers' float32 values in the parameter's dtype, on its device
                torch.from_numpy(np.array(values[k])).reshape(v.shape).to(v.device, v.dtype)
                if k in values
                else v.clone()
            )
        return out

    def close(self) -> None:
        if self.capture is not None:
            self.capture.remove()
        self.remote.close()


class DownpourOptimizer:
    """``zero_grad()``, ``step()`` and ``state_dict()`` of a Downpour replica (one worker: the
    caller's thread). Server optimizer `optimizer` at rate `lr` (torch.optim's names: sgd,
    adagrad, adam, adamw, rmsprop; its other hyperparameters in `optimizer_args`, torch's names
    and defaults; docs/training.md, "Optimizers"); local steps at `local_lr`
    (default `lr`). `compress`: Strom's compression (True, or Compressor options)."""

    def __init__(
        self,
        model: nn.Module,
        *,
        controllers: Sequence[str] = (),
        ps: Sequence[str] = (),
        lr: float = 0.01,
        optimizer: str = "sgd",
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
    ) -> None:
        self.conn = Connection(
            model, controllers=controllers, ps=ps, run=run, token=token, lr=lr,
            optimizer=optimizer, adagrad_initial=adagrad_initial,
            optimizer_args=optimizer_args, create=create,
            act_err=act_err, http_only=http_only,
        )  # fmt: skip
        self.model = model
        self.worker = self.conn.worker(
            local_lr=lr if local_lr is None else local_lr, n_push=n_push, n_fetch=n_fetch,
            compress=compress,
        )  # fmt: skip
        # torch.optim's shape, for code that reads it (schedulers are not supported)
        self.param_groups = [{"params": [p.param for p in self.conn.params], "lr": lr}]

    @property
    def counts(self) -> PushCounts:
        return self.conn.counts

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)
        for t in self.conn.tables:  # the embedding rows' gradients kept for the step
            t.take_grads()

    def step(self) -> None:
        """Checks every gradient (parameters, linear layers' rows, embedding rows), then pushes
        the rows, steps locally and pushes on schedule; a NaN or Inf anywhere raises
        ``RpcError("non_finite")`` with nothing changed, locally or on the servers."""
        self.worker.step({p.tensor: p.param.grad for p in self.conn.params})

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

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state_dict at the servers' parameter values (buffers: this replica's)."""
        return self.conn.server_state_dict()

    def close(self) -> None:
        """Pushes what is left (waiting for the acknowledgement) and closes the connections."""
        try:
            self.worker.close()
        finally:
            self.conn.close()

    def __enter__(self) -> DownpourOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
