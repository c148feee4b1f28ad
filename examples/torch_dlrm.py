"""A DLRM-style click-through model trained by adamps on the data servers' click logs (issue 38):
a bottom MLP over the dense features, an ``adamps.torch.EmbeddingBagCollection`` over the
categorical fields (one server table per field, all of a batch's ids in one request per
server), the pairwise dot products of those vectors (DLRM's interaction), and a top MLP.

    adamps up --torch examples.torch_dlrm:task --epochs 2 --train-arg batch_size=256 \\
        --train-arg optimizer=adagrad --train-arg lr=0.02 --train-arg n_push=1 \\
        --train-arg n_fetch=1

``task`` trains on the planted-truth generator (the data servers' ``--source ctr``: 13 dense
counts, 4 fields); ``criteo`` on a Criteo-format TSV named by ``$ADAMPS_CTR_FILE`` (the data
servers' ``--source ctr:FILE``: 13 dense features, 26 fields). The held-out metric is the AUC.
A batch reaches the model as ``((dense [b, 13], ids [b, fields]), labels)``
(adamps.torch.data.clicks).

``DLRM(..., plain_sizes=...)`` is the same model with plain ``nn.EmbeddingBag`` tables whose
initial rows are the server tables' (adamps.tables.initial_rows of the same init): the
plain-PyTorch reference of tests/pytorch/test_dlrm.py.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout: trainer/ and adamps/ beside it
    sys.path.insert(0, str(ROOT))

import adamps.torch as at  # noqa: E402
from adamps.data.ctr_data import auc  # noqa: E402
from adamps.tables import initial_rows, normalize_row_init  # noqa: E402
from adamps.torch.collection import EmbeddingBagConfig  # noqa: E402

ROW_LR = 0.05
ROW_ADAGRAD_INITIAL = 1e-4


def row_init(field: int) -> dict[str, object]:
    """Field `field`'s table init: small normal rows (not torch's N(0, 1): dot products of
    N(0, 1) rows swamp the top MLP at the start), a seed per field."""
    return {"kind": "normal", "std": 0.05, "seed": 1 + field}


def mlp(sizes: Sequence[int], last_relu: bool) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        if last_relu or i < len(sizes) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class PlainTables(nn.Module):
    """One ``nn.EmbeddingBag`` per field (sparse gradients), its rows the server table's initial
    rows: ids [b, fields] -> [b, fields, dim]."""

    def __init__(self, sizes: Sequence[int], dim: int) -> None:
        super().__init__()
        self.bags = nn.ModuleList()
        for f, n in enumerate(sizes):
            bag = nn.EmbeddingBag(n, dim, mode="sum", sparse=True)
            rows = initial_rows(normalize_row_init(row_init(f)), np.arange(n), dim)
            with torch.no_grad():
                bag.weight.copy_(torch.from_numpy(rows))
            self.bags.append(bag)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(ids[:, f : f + 1]) for f, bag in enumerate(self.bags)], dim=1)


class DLRM(nn.Module):
    """(dense [b, n_dense], ids [b, fields]) -> logit [b]."""

    def __init__(
        self,
        n_dense: int = 13,
        n_fields: int = 4,
        dim: int = 8,
        bottom: Sequence[int] = (32,),
        top: Sequence[int] = (32,),
        plain_sizes: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        # the MLPs first: a plain and a server-table model built after the same torch seed get
        # the same MLP weights
        self.bottom = mlp([n_dense, *bottom, dim], last_relu=True)
        n_pairs = (n_fields + 1) * n_fields // 2
        self.top = mlp([dim + n_pairs, *top, 1], last_relu=False)
        self.fields = [f"f{i}" for i in range(n_fields)]
        self.dim = dim
        self.sparse: nn.Module
        if plain_sizes is not None:
            self.sparse = PlainTables(plain_sizes, dim)
        else:
            self.sparse = at.EmbeddingBagCollection(
                [EmbeddingBagConfig(None, dim, name=f"dlrm_t{i}", feature_names=[f],
                                    init=row_init(i))
                 for i, f in enumerate(self.fields)],
                optimizer="adagrad", lr=ROW_LR, adagrad_initial=ROW_ADAGRAD_INITIAL,
            )  # fmt: skip
        iu = torch.triu_indices(n_fields + 1, n_fields + 1, offset=1)
        self.register_buffer("_pairs", iu, persistent=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [b, fields] -> rows [b, fields, dim] (one keyed jagged lookup for every field)."""
        if isinstance(self.sparse, PlainTables):
            return self.sparse(ids)
        b, f = ids.shape
        kjt = at.KeyedJaggedTensor(
            self.fields, ids.t().reshape(-1), lengths=torch.ones(b * f, dtype=torch.long)
        )
        return self.sparse(kjt).values().reshape(b, f, self.dim)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        dense, ids = x
        d = self.bottom(torch.log1p(dense.clamp(min=0)))  # counts: log scale, as DLRM's Criteo
        z = torch.cat([d.unsqueeze(1), self.embed(ids)], dim=1)  # [b, fields + 1, dim]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self._pairs[0], self._pairs[1]]
        return self.top(torch.cat([d, dots], dim=1)).squeeze(1)


def ctr_auc(outputs: torch.Tensor, targets: torch.Tensor) -> float:
    """The held-out metric: AUC of the logits."""
    return auc(targets.numpy(), outputs.numpy())


def task(examples: int = 40_000) -> at.Task:
    """``adamps up --torch examples.torch_dlrm:task``: DLRM on the data servers' planted-truth
    click logs (``--source ctr``, `examples` rows, a fifth held out)."""
    return at.Task(
        model=DLRM(), loss=nn.BCEWithLogitsLoss(), metric=ctr_auc, source="ctr",
        source_args=("--ctr-examples", str(examples)),
    )  # fmt: skip


def criteo() -> at.Task:
    """``adamps up --torch examples.torch_dlrm:criteo`` with ``ADAMPS_CTR_FILE=day_0.tsv``: DLRM
    on a Criteo-format TSV (26 fields)."""
    path = os.environ.get("ADAMPS_CTR_FILE", "")
    if not path:
        raise ValueError("set ADAMPS_CTR_FILE to a Criteo-format TSV")
    return at.Task(
        model=DLRM(n_fields=26), loss=nn.BCEWithLogitsLoss(), metric=ctr_auc,
        source=f"ctr:{path}",
    )  # fmt: skip
