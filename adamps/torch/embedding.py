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
``sparse_adam`` as torch's SparseAdam, or ``adagrad_legacy``;
docs/training.md, "Optimizers"): there is no local step, so the next
forward pulls the updated rows.

``padding_idx`` is torch's: that id's row reads as zeros (the value torch gives it), is left out
of an EmbeddingBag's reduction, and is neither pulled nor pushed, so the servers never update it.
``max_norm`` (with ``norm_type``) renormalizes the pulled rows as ``F.embedding`` does
(``torch.embedding_renorm_``), so a forward and its row gradients are torch's; torch also writes
the renormalized rows back into its weight, and here the servers' rows keep their norm: the next
step's optimizer starts from the stored row, not the renormalized one (docs/training.md).
Refused, as nothing but the servers' optimizer writes a row: ``scale_grad_by_freq``,
``_weight`` / ``_freeze`` (``sparse`` is accepted and ignored: the updates are always sparse).

Devices: the ids may be on any device; their distinct ids go to the host for the pull, and the
rows come back to ``device`` (default: the ids' device) as ``dtype`` (float32, bfloat16 or
float16; default float32) through a reused pinned buffer (adamps/torch/staging.py). The row
gradients stay on the device until the optimizer's step copies them with the others.

``row_dtype`` ("float16" or "bfloat16", a torch dtype, or torchrec's ``DataType``; default
float32) is how the servers store the table's values: half the memory and disk per value, each
update computed in float32 and rounded back; the optimizer's state stays float32 (use
``rowwise_adagrad`` for one accumulator per row). Rows still travel as float32.

``row_leaves`` is the one place a forward's pulled rows become a leaf whose gradient is pushed:
``EmbeddingBagCollection`` (adamps/torch/collection.py) gives it the rows of all its tables at
once, so their gradients travel in one ``round`` (one request per server).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
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


class Lookup:
    """One table's part of a forward: the distinct ids to pull (the padding id left out) and
    each id's index into the rows ``weight`` gives (the padding id's: a zero row after them)."""

    def __init__(self, ids: torch.Tensor, padding_idx: int | None) -> None:
        uniq, inv = torch.unique(ids.reshape(-1), return_inverse=True)
        #: the padding row's local index (the last row of ``weight``), None if not in the batch
        self.pad: int | None = None
        if padding_idx is not None:
            hit = (uniq == padding_idx).nonzero()
            if len(hit):
                k = int(hit[0, 0])
                uniq = torch.cat([uniq[:k], uniq[k + 1 :]])
                self.pad = len(uniq)
                inv = torch.where(inv == k, self.pad, inv - (inv > k).long())
        #: the ids' device: where the rows go unless the module names one
        self.device = ids.device
        #: the distinct ids whose rows are pulled (and pushed), int64, on the host
        self.ids: np.ndarray = uniq.to("cpu", torch.int64).numpy()
        #: every id's index into ``weight(rows)``, in the shape of the ids
        self.index = inv.reshape(ids.shape)

    def weight(self, rows: torch.Tensor) -> torch.Tensor:
        """The pulled rows, with the padding id's zero row after them if the batch has it."""
        if self.pad is None:
            return rows
        return torch.cat([rows, rows.new_zeros((1, rows.shape[1]))])


#: torch's and torchrec's (DataType) names of the value types a table may store its rows in
_ROW_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    "fp32": "float32",
    "fp16": "float16",
    "bf16": "bfloat16",
}


def row_dtype_name(d: Any) -> str:
    """The servers' name ("float32", "float16", "bfloat16") of a table's row storage given as
    that name, a torch dtype, or torchrec's ``DataType`` (FP32, FP16, BF16); None: float32."""
    if d is None:
        return "float32"
    key = d if isinstance(d, torch.dtype) else str(getattr(d, "value", d)).lower()
    name = key if key in ("float32", "float16", "bfloat16") else _ROW_DTYPE_NAMES.get(key)
    if name is None:
        raise ModelError(
            f"row_dtype must be float32, float16 or bfloat16 (a name, a torch dtype or "
            f"torchrec's DataType), got {d!r}"
        )
    return name


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
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = True,
        _weight: Any = None,
        _freeze: bool = False,
        device: Any = None,
        dtype: Any = None,
        row_dtype: Any = None,
    ) -> None:
        super().__init__()
        refused = {
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
                f"{type(self).__name__}: the module's rows may be float32, bfloat16 or "
                f"float16, not {dtype} (row_dtype= sets how the servers store them)"
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
        #: the id whose row reads as zeros and is never pulled nor pushed (torch's, made >= 0)
        self.padding_idx = _padding(padding_idx, num_embeddings)
        if max_norm is not None and (
            isinstance(max_norm, bool) or not isinstance(max_norm, int | float) or max_norm <= 0
        ):
            raise ModelError(f"max_norm must be a positive number or None, got {max_norm!r}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, int | float) or norm_type <= 0:
            raise ModelError(f"norm_type must be a positive number, got {norm_type!r}")
        #: pulled rows longer than this (in the norm_type norm) are scaled down to it
        self.max_norm = None if max_norm is None else float(max_norm)
        self.norm_type = float(norm_type)
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
        #: how the servers store the rows: "float32", "float16" or "bfloat16" (rowdtype.py)
        self.row_dtype = row_dtype_name(row_dtype)
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
                dtype=None if self.row_dtype == "float32" else self.row_dtype,
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

    def client(self) -> Any:
        """The client this module is bound to; RuntimeError naming the table when unbound."""
        if self._binding.client is None:
            raise RuntimeError(
                f"{type(self).__name__} {self.table!r} is not bound to servers: give it to a "
                "DownpourOptimizer or Replica, or call .bind(client)"
            )
        return self._binding.client

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

    def lookup(self, ids: torch.Tensor) -> Lookup:
        """The distinct ids of `ids` to pull (checked as torch checks them) and their indices."""
        return Lookup(self._ids(ids), self.padding_idx)

    def pulled(self, ids: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
        """The rows pulled for `ids` (None: nothing pulled, no id), counted as moved and
        renormalized to ``max_norm`` as ``F.embedding`` renormalizes its weight's."""
        if rows is None:
            return np.empty((0, self.embedding_dim), np.float32)
        self.bytes_moved += ids.nbytes + rows.nbytes
        if self.max_norm is not None and len(ids):
            with torch.no_grad():
                idx = torch.arange(len(ids))
                torch.embedding_renorm_(torch.from_numpy(rows), idx, self.max_norm, self.norm_type)
        return rows

    def _rows(self, ids: torch.Tensor) -> tuple[torch.Tensor, Lookup]:
        """(the batch's rows as a leaf that pushes its gradient, with the padding row; the
        lookup)."""
        lk = self.lookup(ids)
        client = self.client()
        got = client.pull_rows(self._binding.table, lk.ids) if len(lk.ids) else None
        [rows] = row_leaves([self], [lk.ids], [self.pulled(lk.ids, got)], lk.device)
        return lk.weight(rows), lk

    def keep(self, ids: np.ndarray, grads: torch.Tensor) -> None:
        """Keeps a row gradient for this thread's step (``take_grads``)."""
        last = self._binding.last
        pending = getattr(last, "pending", None)
        if pending is None:
            pending = last.pending = []
        pending.append((ids, grads))

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
        extra = f", padding_idx={self.padding_idx}" if self.padding_idx is not None else ""
        extra += f", max_norm={self.max_norm}" if self.max_norm is not None else ""
        return f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}{extra}"


def _padding(padding_idx: Any, num_embeddings: int | None) -> int | None:
    """torch's rule: an id in ``[-num_embeddings, num_embeddings)``, a negative one counted from
    the end (so it needs ``num_embeddings``); None: no padding id."""
    if padding_idx is None:
        return None
    if isinstance(padding_idx, bool) or not isinstance(padding_idx, int):
        raise ModelError(f"padding_idx must be an int or None, got {padding_idx!r}")
    if num_embeddings is None:
        if padding_idx < 0:
            raise ModelError(
                f"padding_idx {padding_idx} counts from the end of the table: give "
                "num_embeddings, or a padding_idx >= 0"
            )
        return padding_idx
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ModelError(
            f"padding_idx {padding_idx} must be within num_embeddings ({num_embeddings})"
        )
    return padding_idx % num_embeddings


def row_leaves(
    tables: Sequence[_RowTable],
    ids: Sequence[np.ndarray],
    rows: Sequence[np.ndarray],
    device: torch.device | None = None,
) -> list[torch.Tensor]:
    """The pulled `rows` of each of `tables` (for its distinct `ids`) as views of ONE leaf that
    requires grad (under no_grad: plain tensors). Its gradient is each distinct row's, duplicates
    summed; a hook hands it over once, as soon as backward computes it: kept for the step
    (bound with ``defer``), else pushed, in one push_rows for one table and in one ``round`` (one
    request per server) for several. The leaf is the first table's ``take_leaf`` (Replica's
    ``torch.autograd.grad`` input). The rows go to each table's ``device`` (else `device`, the
    ids', else the CPU) in its ``dtype``."""
    cpu = torch.device("cpu")
    ts = [
        t._stage.rows_to_device("rows", r, t.device or device or cpu, t.dtype)
        for t, r in zip(tables, rows, strict=True)
    ]
    if not torch.is_grad_enabled():
        return ts
    if len(ts) == 1:
        leaf = ts[0]
    else:
        leaf = torch.cat([t.reshape(-1) for t in ts])
    leaf.requires_grad_(True)
    sizes = [r.size for r in rows]
    if len(ts) == 1:
        views = [leaf]
    else:
        views = [v.view(r.shape) for v, r in zip(leaf.split(sizes), rows, strict=True)]
    state = {"pushed": False}

    def push(grad: torch.Tensor) -> None:
        if state["pushed"]:  # backward run again on a retained graph: pushed already
            return
        state["pushed"] = True
        flat = grad.detach().reshape(-1)
        parts = []
        for t, u, g in zip(tables, ids, flat.split(sizes), strict=True):
            if len(u):  # a table without ids in this batch has no row to push
                parts.append((t, u, g.reshape(len(u), t.embedding_dim)))
        if not parts:
            return
        if tables[0]._binding.defer:  # kept on the device: the step copies them with the rest
            for t, u, g in parts:
                t.keep(u, g)
            return
        parts = [(t, u, g.to("cpu", torch.float32).numpy()) for t, u, g in parts]
        if len(parts) == 1:
            t, u, g = parts[0]
            t.push_grads([(u, g)])
        else:
            entries = [t.round_rows([(u, g)]) for t, u, g in parts]
            tables[0].client().round(rows=dict(e for e in entries if e is not None))

    leaf.register_hook(push)
    for i, t in enumerate(tables):
        t._binding.last.leaf = leaf if i == 0 else None
    return views


class Embedding(_RowTable):
    """``ids [*] -> rows [*, embedding_dim]`` (torch.nn.Embedding's signature, plus ``table``,
    ``optimizer``, ``lr``, ``init`` and ``client``)."""

    def __init__(
        self,
        num_embeddings: int | None,
        embedding_dim: int,
        padding_idx: int | None = None,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = True,
        _weight: Any = None,
        _freeze: bool = False,
        device: Any = None,
        dtype: Any = None,
        **table: Any,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, padding_idx=padding_idx, max_norm=max_norm,
            norm_type=norm_type, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse,
            _weight=_weight, _freeze=_freeze, device=device, dtype=dtype, **table,
        )  # fmt: skip

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight, lk = self._rows(input)
        return F.embedding(lk.index, weight)


class EmbeddingBag(_RowTable):
    """``ids [B, N]`` or ``ids [n] + offsets [B]`` -> pooled rows ``[B, embedding_dim]``
    (torch.nn.EmbeddingBag's signature: ``mode`` "sum", "mean" or "max", ``per_sample_weights``,
    ``include_last_offset``, ``padding_idx``, ``max_norm``; plus ``table``, ``optimizer``,
    ``lr``, ``init``, ``client``)."""

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
            num_embeddings, embedding_dim, max_norm=max_norm, norm_type=norm_type,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, _weight=_weight,
            padding_idx=padding_idx, device=device, dtype=dtype, **table,
        )  # fmt: skip
        self.mode = mode
        self.include_last_offset = include_last_offset

    def forward(
        self,
        input: torch.Tensor,
        offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        weight, lk = self._rows(input)
        return self.pool(lk.index, lk.pad, weight, offsets, per_sample_weights,
                         self.include_last_offset)  # fmt: skip

    def pool(
        self,
        index: torch.Tensor,
        pad: int | None,
        weight: torch.Tensor,
        offsets: torch.Tensor | None,
        per_sample_weights: torch.Tensor | None,
        include_last_offset: bool,
    ) -> torch.Tensor:
        """torch's ``F.embedding_bag`` of a lookup's indices over its rows (`pad`: the padding
        row's index, left out of the reduction as torch leaves it)."""
        return F.embedding_bag(
            index, weight, offsets, mode=self.mode, per_sample_weights=per_sample_weights,
            include_last_offset=include_last_offset, padding_idx=pad,
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
