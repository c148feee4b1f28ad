"""``Connection``: a model, its server tensors and the act/err hooks, which every optimizer of
adamps.torch (server_optim.py: ``DownpourOptimizer``, ``AdamW``, ...) and every Hogwild worker
of a ``Replica`` share.

Construction checks the model (adamps/torch/params.py), the servers' tensors of the run (a
tensor of another shape: an error naming it, nothing created), creates the missing ones from the
model's values when ``create`` is true (replica 0's job; a resumed run keeps the servers'
values) and pulls the servers' values into the model: every replica starts from the same
weights. ``nn.Linear`` weights push activation/error rows captured by hooks: they are the raw
gradient of the loss, so give ``act_err=False`` when the loop changes gradients before
``step()`` (clipping, weight decay added to ``.grad``); every other parameter pushes ``.grad``.

The model's small parameters go to the servers in placement groups (``fuse=True``, the default;
adamps/torch/params.py): a small model's push round touches a few buckets. A run created before
groups existed keeps its plain names (``RemoteModel.adopt_plain_names``).

Buffers (BatchNorm's running statistics) are not parameters: they stay in each replica's model
and are trained by its own forward passes; ``server_state_dict()`` of replica 0 is what the CLI
exports.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from adamps.core.staleness import divides
from adamps.torch import launch_env
from adamps.torch.downpour import PushCounts, WorkerDownpour
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
        specs: Mapping[str, Mapping[str, Any]] | None = None,
        fuse: bool = True,
    ) -> None:
        # not given: from `adamps launch`'s environment or the cluster file (launch_env.py)
        controllers, run, token = launch_env.connection_defaults(controllers, ps, run, token)
        self.model = model
        #: the model's adamps Embedding / EmbeddingBag modules (rows on the servers' tables)
        self.tables = row_tables(model)
        self.params: list[Param] = model_params(
            model, run, named_parameters, allow_empty=bool(self.tables), fuse=fuse
        )
        self.optimizer = optimizer_spec(optimizer, lr, adagrad_initial, optimizer_args)
        self.remote = RemoteModel(
            self.params, controllers=list(controllers), ps=list(ps), token=token,
            http_only=http_only,
        )  # fmt: skip
        try:
            self.params = self.remote.adopt_plain_names()
        except BaseException:
            self.remote.close()
            raise
        self.remote.lr = float(self.optimizer["lr"])
        # `specs`: parameter name -> its param group's optimizer (server_optim.py)
        per = {p.tensor: specs[p.name] for p in self.params} if specs else {}
        self.remote.unscaled = {
            p.tensor for p in self.params if not divides(per.get(p.tensor, self.optimizer))
        }
        self.created: list[str] = []
        try:
            if create:
                if controllers:  # GET /layout and `adamps status --run` show the run
                    launch_env.publish_layout(controllers, token, self.remote.layout, run)
                self.created = self.remote.create(self.optimizer, per or None)
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
        staleness: str = "auto",
    ) -> WorkerDownpour:
        """The Downpour rule of one more worker (its own accumulators and compressor), stepping
        `params` (default: the model's; a Hogwild worker's own tensors on the same memory)."""
        comp = None
        if compress:
            from adamps.compression.error_feedback import Compressor

            opts = compress if isinstance(compress, dict) else {}
            comp = Compressor(self.remote.layout.shards_of, **opts)
        return WorkerDownpour(
            self.remote, self.params if params is None else params, self.capture, local_lr=local_lr, n_push=n_push,
            n_fetch=n_fetch, compressor=comp, counts=self.counts, asynchronous=asynchronous,
            tables=self.tables, staleness=staleness,
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
