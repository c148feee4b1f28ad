"""``adamps.torch.Embedding`` and ``EmbeddingBag``: ``torch.nn.Embedding`` /
``torch.nn.EmbeddingBag`` whose rows live in a parameter server's embedding table (issue 23).

    emb = adamps.torch.EmbeddingBag(None, 16, mode="sum", table="items", lr=0.05)
    model = nn.Sequential(...)            # uses emb
    opt = adamps.torch.DownpourOptimizer(model, controllers=[...])   # binds emb, creates the table
    # or, in a loop of one's own: emb.bind(ps_client)

The table has no size: ``num_embeddings`` may be None (any int64 id), or an int, and then an id
outside ``[0, num_embeddings)`` is an error, as in torch. The module holds no ``nn.Parameter``:
the rows are the servers', so ``named_parameters()`` (what Downpour pushes as dense tensors)
never sees them.

``forward`` takes the batch's **distinct** ids (``torch.unique``), pulls their rows (one
``pull_rows``) into a leaf tensor that requires grad, and computes the output from it with torch's
own ``F.embedding`` / ``F.embedding_bag`` on the local indices, so everything torch does to the
batch (offsets, ``per_sample_weights``, modes) is torch's code. The leaf's gradient is then the
gradient of each distinct row with duplicates already summed, and a hook on it pushes it (one
``push_rows``, exactly-once by the client's ``(client, seq)``) as soon as backward computes it:
``loss.backward()`` and ``torch.autograd.grad(loss, [..., *take_row_leaves(tables)])`` (what
``Replica`` does) both push. A forward's rows are pushed at most once, even if the graph is
backpropagated again; a forward that is never backpropagated (evaluation) pushes nothing.

Bound by a ``DownpourOptimizer`` or a ``Replica`` (``defer``), the hook keeps the gradient and
the optimizer's ``step()`` pushes it, after checking every gradient of the step (a NaN anywhere,
rows or dense, refuses the whole step before any server applies anything); ``zero_grad()``
drops what was kept, as it drops ``.grad``. Bound by ``.bind(client)`` alone there is no step:
the hook pushes, and a NaN row gradient refuses that push whole.

The servers apply their table's per-row optimizer (``optimizer`` and ``lr`` here: ``sgd``,
torch's ``adagrad`` per element, ``rowwise_adagrad`` with one accumulator per row as TorchRec's,
or ``adagrad_legacy``; docs/training.md, "Optimizers"): there is no local step, so the next
forward pulls the updated rows. What cannot apply to a table of the servers and is refused:
``padding_idx``, ``max_norm``, ``scale_grad_by_freq``, ``_weight`` / ``_freeze`` (``sparse`` is
accepted and ignored: the updates are always sparse).

Devices: the ids may be on any device; their distinct ids go to the host for the pull, and the
rows come back to ``device`` (default: the ids' device) as ``dtype`` (float32, bfloat16 or
float16; default float32) through a reused pinned buffer (adamps/torch/staging.py). The row
gradients stay on the device until the optimizer's step copies them with the others.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from adamps.torch.params import ModelError, tensor_name
from adamps.torch.remote import optimizer_spec
from adamps.torch.staging import PARAM_DTYPES, HostStage


class _Binding:
    """The client a module pulls and pushes through, and its table's full name. Shared, not
    copied, by ``copy.deepcopy`` (a Hogwild twin uses the same client: PSClient is
    thread-safe)."""

    def __init__(self) -> None:
        self.client: Any = None
        self.table: str | None = None
        #: each thread's last forward's rows leaf, and its row gradients kept for the step
        #: (`pending`, with `defer`); a Hogwild worker is a thread: its own
        self.last = threading.local()
        #: keep the row gradients for the optimizer's step instead of pushing them in backward
        self.defer = False

    def __deepcopy__(self, memo: dict[int, Any]) -> _Binding:
        return self


class _RowTable(nn.Module):
    """What Embedding and EmbeddingBag share: the table, the binding, pull and push."""

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        *,
        table: str,
        optimizer: str = "sgd",
        lr: float = 0.01,
        adagrad_initial: float = 0.0,
        optimizer_args: Mapping[str, Any] | None = None,
        init: Mapping[str, Any] | None = None,
        admission: Mapping[str, Any] | None = None,
        client: Any = None,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        scale_grad_by_freq: bool = False,
        sparse: bool = True,
        _weight: Any = None,
        _freeze: bool = False,
        device: Any = None,
        dtype: Any = None,
    ) -> None:
        super().__init__()
        refused = {
            "padding_idx": padding_idx is not None,
            "max_norm": max_norm is not None,
            "scale_grad_by_freq": bool(scale_grad_by_freq),
            "_weight": _weight is not None,
            "_freeze": bool(_freeze),
        }
        bad = [k for k, v in refused.items() if v]
        if bad:
            raise ModelError(
                f"{type(self).__name__}: {', '.join(bad)} cannot apply to a parameter server's "
                "table (its rows are updated only by the servers' optimizer)"
            )
        if dtype is not None and dtype not in PARAM_DTYPES:
            raise ModelError(
                f"{type(self).__name__}: the servers hold float32 rows; the module's rows may "
                f"be float32, bfloat16 or float16, not {dtype}"
            )
        if num_embeddings is not None and (
            isinstance(num_embeddings, bool)
            or not isinstance(num_embeddings, int)
            or num_embeddings < 1
        ):
            raise ModelError(
                f"num_embeddings must be a positive int or None, got {num_embeddings!r}"
            )
        if (
            isinstance(embedding_dim, bool)
            or not isinstance(embedding_dim, int)
            or embedding_dim < 1
        ):
            raise ModelError(f"embedding_dim must be a positive int, got {embedding_dim!r}")
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.sparse = True
        #: where the rows go (None: the device of the ids) and their dtype (float32 by default)
        self.device = torch.device(device) if device is not None else None
        self.dtype = dtype if dtype is not None else torch.float32
        #: the host buffers the rows reach the device through (adamps/torch/staging.py)
        self._stage = HostStage()
        #: the table's name in its run (the servers' table is RUN..TABLE, adamps.torch.params)
        self.table = table
        self.optimizer = optimizer_spec(optimizer, lr, adagrad_initial, optimizer_args, table=True)
        # torch's nn.Embedding starts from N(0, 1); the seed is the table's, so that every
        # replica (and every copy of a bucket) creates a row with the same value
        self.init = dict(init) if init is not None else {"kind": "normal", "std": 1.0, "seed": 0}
        if admission is not None and not isinstance(admission, Mapping):
            raise ModelError(f"admission must be a mapping (max_rows, ...), got {admission!r}")
        #: the table's admission (row limit, frequency filter, expiry; docs/protocol-ps.md): a
        #: run with a table_rows quota needs its max_rows
        self.admission = dict(admission) if admission is not None else None
        self._binding = _Binding()
        #: bytes of ids, rows and row gradients moved by this module's pulls and pushes
        self.bytes_moved = 0
        if client is not None:
            self.bind(client)

    def bind(
        self, client: Any, run: str | None = None, create: bool = True, defer: bool = False
    ) -> None:
        """Pull and push through `client` (a PSClient), to the table ``RUN..TABLE``, created on
        the servers if `create` (idempotent: a table that exists with the same definition is
        kept with its rows; another definition is an error naming it). `defer`: the row
        gradients wait for ``take_grads`` (an optimizer's step) instead of being pushed."""
        name = tensor_name(run, self.table)
        if create:
            client.create_table(
                name,
                self.embedding_dim,
                init=self.init,
                optimizer=self.optimizer,
                admission=self.admission,
            )
        else:
            client.tables[name] = self.embedding_dim
        self._binding.client = client
        self._binding.table = name
        self._binding.defer = defer

    @property
    def server_table(self) -> str | None:
        """The servers' name of the table (None until bound)."""
        return self._binding.table

    def _ids(self, input: torch.Tensor) -> torch.Tensor:
        if not isinstance(input, torch.Tensor) or input.dtype not in (torch.int64, torch.int32):
            raise TypeError(
                f"{type(self).__name__} expects a LongTensor or IntTensor of ids, got "
                f"{getattr(input, 'dtype', type(input).__name__)}"
            )
        if self.num_embeddings is not None and input.numel():
            lo, hi = int(input.min()), int(input.max())
            if lo < 0 or hi >= self.num_embeddings:
                raise IndexError(
                    f"id {lo if lo < 0 else hi} is out of range [0, {self.num_embeddings})"
                )
        return input

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the distinct ids' rows as a leaf that pushes its gradient, local index per id)."""
        b = self._binding
        if b.client is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.table!r} is not bound to servers: give it to a "
                "DownpourOptimizer or Replica, or call .bind(client)"
            )
        uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
        # the ids to the host (a device's ids wait for their copy: the pull needs them), the
        # rows back through a reused (pinned) buffer
        u = uniq.to("cpu", torch.int64).numpy()
        pulled = b.client.pull_rows(b.table, u)
        rows = self._stage.rows_to_device("rows", pulled, self.device or ids.device, self.dtype)
        self.bytes_moved += u.nbytes + pulled.nbytes
        if not torch.is_grad_enabled():
            return rows, inv.reshape(ids.shape)
        rows.requires_grad_(True)
        state = {"pushed": False}

        def push(grad: torch.Tensor) -> None:
            if state["pushed"]:  # backward run again on a retained graph: pushed already
                return
            state["pushed"] = True
            if b.defer:  # kept on its device: the step copies it with the other gradients
                pending = getattr(b.last, "pending", None)
                if pending is None:
                    pending = b.last.pending = []
                pending.append((u, grad.detach()))
                return
            self.push_grads([(u, grad.detach().to("cpu", torch.float32).numpy())])

        rows.register_hook(push)
        self._binding.last.leaf = rows
        return rows, inv.reshape(ids.shape)

    def take_grads(self) -> list[tuple[np.ndarray, torch.Tensor]]:
        """This thread's row gradients kept for the step (host ids, gradients on the rows'
        device), forgotten here."""
        last = self._binding.last
        pending = getattr(last, "pending", None) or []
        last.pending = None
        return pending

    def push_grads(self, grads: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """Pushes row gradients (ids, grads) in one push_rows (duplicate ids are summed)."""
        got = self.round_rows(grads)
        if got is not None:
            self._binding.client.push_rows(got[0], *got[1])

    def round_rows(
        self, grads: list[tuple[np.ndarray, np.ndarray]]
    ) -> tuple[str, tuple[np.ndarray, np.ndarray]] | None:
        """Row gradients (ids, grads) as one entry of a round's rows (server table, (ids,
        grads)), counted as moved; None when no id has one."""
        grads = [(u, g) for u, g in grads if len(u)]  # a batch without ids has no row to push
        if not grads:
            return None
        b = self._binding
        if len(grads) == 1:
            u, g = grads[0]
        else:
            u, g = np.concatenate([x[0] for x in grads]), np.concatenate([x[1] for x in grads])
        self.bytes_moved += u.nbytes + g.nbytes
        assert b.table is not None
        return b.table, (u, g)

    def take_leaf(self) -> torch.Tensor | None:
        """This thread's last forward's rows leaf (None if none), forgotten here: the input
        whose gradient ``torch.autograd.grad`` must compute for the push to happen."""
        last = self._binding.last
        leaf = getattr(last, "leaf", None)
        last.leaf = None
        return leaf

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}"


class Embedding(_RowTable):
    """``ids [*] -> rows [*, embedding_dim]`` (torch.nn.Embedding's signature, plus ``table``,
    ``optimizer``, ``lr``, ``init`` and ``client``)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        rows, inv = self._rows(self._ids(input))
        return F.embedding(inv, rows)


class EmbeddingBag(_RowTable):
    """``ids [B, N]`` or ``ids [n] + offsets [B]`` -> pooled rows ``[B, embedding_dim]``
    (torch.nn.EmbeddingBag's signature: ``mode`` "sum", "mean" or "max", ``per_sample_weights``,
    ``include_last_offset``; plus ``table``, ``optimizer``, ``lr``, ``init``, ``client``)."""

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        mode: str = "mean",
        sparse: bool = True,
        _weight: Any = None,
        include_last_offset: bool = False,
        padding_idx: int | None = None,
        device: Any = None,
        dtype: Any = None,
        **table: Any,
    ) -> None:
        if mode not in ("sum", "mean", "max"):
            raise ModelError(f"mode must be 'sum', 'mean' or 'max', got {mode!r}")
        super().__init__(
            num_embeddings, embedding_dim, max_norm=max_norm, scale_grad_by_freq=scale_grad_by_freq,
            sparse=sparse, _weight=_weight, padding_idx=padding_idx, device=device, dtype=dtype,
            **table,
        )  # fmt: skip
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, inv = self._rows(self._ids(input))
        return F.embedding_bag(
            inv, rows, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=self.include_last_offset,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return super().extra_repr() + f", mode={self.mode!r}"


def row_tables(model: nn.Module) -> list[_RowTable]:
    """The adamps embedding modules of `model` (each once; none when `model` is not a module:
    model_params then names the problem)."""
    if not isinstance(model, nn.Module):
        return []
    return [m for m in model.modules() if isinstance(m, _RowTable)]


def bind_tables(
    model: nn.Module, client: Any, run: str | None, create: bool, defer: bool = False
) -> list[str]:
    """Binds every embedding module of `model` to `client`; returns the servers' table names."""
    names = []
    for m in row_tables(model):
        m.bind(client, run, create, defer)
        names.append(m.server_table)
    return [n for n in names if n is not None]


def take_row_leaves(modules: Iterable[_RowTable]) -> list[torch.Tensor]:
    """This thread's last forward's row leaves of `modules` (each taken once)."""
    return [leaf for m in modules if (leaf := m.take_leaf()) is not None]
