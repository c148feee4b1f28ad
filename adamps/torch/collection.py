"""``adamps.torch.EmbeddingBagCollection``: all the sparse features of a batch in one lookup
(TorchRec's ``EmbeddingBagCollection``; issue 38 item 4).

    ebc = adamps.torch.EmbeddingBagCollection([
        EmbeddingBagConfig(name="user", embedding_dim=8, num_embeddings=None,
                           feature_names=["user_id"]),
        EmbeddingBagConfig(name="item", embedding_dim=16, num_embeddings=None,
                           feature_names=["item_id", "seen_items"], pooling="mean"),
    ], optimizer="adagrad", lr=0.05)
    pooled = ebc(kjt)                 # a KeyedJaggedTensor -> KeyedTensor
    pooled.values()                   # [B, 8 + 16 + 16], features in the configs' order
    pooled["seen_items"]              # [B, 16]

Each config is one table on the servers (``RUN..NAME``), held by an ``adamps.torch.EmbeddingBag``
in ``embedding_bags`` (so ``DownpourOptimizer`` and ``Replica`` find, bind and create it as any
other); several features may share a table. A forward takes each table's distinct ids over all
its features and fetches every table's rows in ONE ``round`` (one request per server, however
many tables), then pools each feature with torch's ``F.embedding_bag`` (``pooling`` "sum" or
"mean"; with ``is_weighted`` the batch's weights are ``per_sample_weights``, sum pooling). The
rows of all the tables are one leaf (``row_leaves``): their gradients are kept for the
optimizer's step, which sends them in its one round, or, bound by ``.bind(client)`` alone,
pushed in one round by backward. ``padding_idx``, ``max_norm`` and ``norm_type`` are per table,
as ``adamps.torch.EmbeddingBag``'s.

The batch is torchrec's ``KeyedJaggedTensor`` where torchrec is installed, or
``adamps.torch.KeyedJaggedTensor`` (adamps/torch/jagged.py): anything with its methods.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adamps.torch.embedding import EmbeddingBag, Lookup, row_leaves
from adamps.torch.jagged import KeyedTensor, features
from adamps.torch.params import ModelError


@dataclass
class EmbeddingBagConfig:
    """One table of a collection (torchrec's ``EmbeddingBagConfig`` fields, plus the table's
    ``padding_idx``, ``max_norm``, ``norm_type``, and ``init`` / ``admission`` overriding the
    collection's). ``num_embeddings`` None: any int64 id."""

    num_embeddings: int | None
    embedding_dim: int
    name: str = ""
    feature_names: list[str] = field(default_factory=list)
    #: "sum" or "mean" (torchrec's PoolingType.SUM / MEAN are accepted too)
    pooling: Any = "sum"
    padding_idx: int | None = None
    max_norm: float | None = None
    norm_type: float = 2.0
    init: Mapping[str, Any] | None = None
    admission: Mapping[str, Any] | None = None
    #: how the servers store the table's rows (torchrec's field): "float32" / DataType.FP32,
    #: "float16" / FP16, "bfloat16" / BF16; None: the collection's ``row_dtype`` (float32)
    data_type: Any = None


def _pooling(p: Any) -> str:
    """ "sum" / "mean" from a string or an enum such as torchrec's PoolingType."""
    name = str(getattr(p, "value", p)).lower()
    if name not in ("sum", "mean"):
        raise ModelError(f"pooling must be 'sum' or 'mean', got {p!r}")
    return name


class EmbeddingBagCollection(nn.Module):
    """``KeyedJaggedTensor -> KeyedTensor`` over the tables of `tables` (configs: this
    module's ``EmbeddingBagConfig`` or torchrec's). Keyword arguments (``optimizer``, ``lr``,
    ``adagrad_initial``, ``optimizer_args``, ``init``, ``admission``, ``row_dtype``, ``client``)
    go to every table's ``adamps.torch.EmbeddingBag``; a config's ``init`` / ``admission`` /
    ``data_type`` win."""

    def __init__(
        self,
        tables: Sequence[Any],
        is_weighted: bool = False,
        device: Any = None,
        **options: Any,
    ) -> None:
        super().__init__()
        if not tables:
            raise ModelError("an EmbeddingBagCollection needs at least one table config")
        client = options.pop("client", None)
        self._is_weighted = bool(is_weighted)
        self._configs = list(tables)
        bags: dict[str, EmbeddingBag] = {}
        #: feature -> its table's name, in the output's order (the configs', then their features')
        self.feature_table: dict[str, str] = {}
        for c in tables:
            name = getattr(c, "name", "")
            if not isinstance(name, str) or not name or name in bags:
                raise ModelError(f"each table config needs a distinct name, got {name!r}")
            feats = list(getattr(c, "feature_names", None) or [])
            if not feats:
                raise ModelError(f"table {name!r} has no feature_names")
            pooling = _pooling(getattr(c, "pooling", "sum"))
            if self._is_weighted and pooling != "sum":
                raise ModelError(
                    f"table {name!r}: weighted features are pooled by sum (torch's "
                    f"per_sample_weights), not {pooling!r}"
                )
            kw = dict(options)
            for k in ("init", "admission"):
                if getattr(c, k, None) is not None:
                    kw[k] = getattr(c, k)
            if getattr(c, "data_type", None) is not None:
                kw["row_dtype"] = c.data_type
            bags[name] = EmbeddingBag(
                c.num_embeddings, c.embedding_dim, mode=pooling, table=name, device=device,
                padding_idx=getattr(c, "padding_idx", None), max_norm=getattr(c, "max_norm", None),
                norm_type=getattr(c, "norm_type", 2.0), **kw,
            )  # fmt: skip
            for f in feats:
                if f in self.feature_table:
                    raise ModelError(
                        f"feature {f!r} is in tables {self.feature_table[f]!r} and {name!r}: "
                        "one table per feature"
                    )
                self.feature_table[f] = name
        #: table name -> its module (torchrec's attribute name)
        self.embedding_bags = nn.ModuleDict(bags)
        if client is not None:
            self.bind(client)

    def bind(
        self, client: Any, run: str | None = None, create: bool = True, defer: bool = False
    ) -> None:
        """Binds every table (``EmbeddingBag.bind``): in a loop of one's own, backward pushes."""
        for m in self.embedding_bags.values():
            m.bind(client, run, create, defer)

    def feature_names(self) -> list[str]:
        return list(self.feature_table)

    def is_weighted(self) -> bool:
        """Whether the batch's weights are pooled (torchrec's method)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> list[Any]:
        """The table configs, as given (torchrec's method)."""
        return list(self._configs)

    def forward(self, features_: Any) -> KeyedTensor:
        feats = features(features_, list(self.feature_table))
        bs = {len(n) for _, n, _ in feats.values()}
        if len(bs) != 1:
            raise ValueError(f"the features have different batch sizes {sorted(bs)}")
        mods: list[EmbeddingBag] = list(self.embedding_bags.values())
        by_table: dict[str, list[str]] = {}
        for f, t in self.feature_table.items():
            by_table.setdefault(t, []).append(f)
        looks: list[Lookup] = []
        for m in mods:
            ids = [feats[f][0] for f in by_table[m.table]]
            looks.append(m.lookup(torch.cat(ids) if len(ids) > 1 else ids[0]))
        client = mods[0].client()
        if any(m.client() is not client for m in mods):
            raise RuntimeError("the tables of an EmbeddingBagCollection are bound to one client")
        # every table's rows in one round: one request per server
        want = {m.server_table: lk.ids for m, lk in zip(mods, looks, strict=True) if len(lk.ids)}
        got = client.round(fetch_rows=want) if want else {}
        rows = [
            m.pulled(lk.ids, got.get(m.server_table)) for m, lk in zip(mods, looks, strict=True)
        ]
        leaves = row_leaves(mods, [lk.ids for lk in looks], rows, looks[0].device)
        pooled: dict[str, torch.Tensor] = {}
        for m, lk, leaf in zip(mods, looks, leaves, strict=True):
            weight = lk.weight(leaf)
            start = 0
            for f in by_table[m.table]:
                ids, lengths, w = feats[f]
                index = lk.index[start : start + len(ids)]
                start += len(ids)
                psw = None
                if self._is_weighted:
                    if w is None:
                        raise ValueError(f"is_weighted, but the batch has no weights for {f!r}")
                    psw = w.to(torch.float32)
                offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
                pooled[f] = m.pool(index, lk.pad, weight, offsets, psw, True)
        names = list(self.feature_table)
        dims = [self.embedding_bags[self.feature_table[f]].embedding_dim for f in names]
        return KeyedTensor(names, dims, torch.cat([pooled[f] for f in names], dim=1))
