"""A small transformer encoder that reads an MNIST image as a sequence of its 28 rows (each row a
28-pixel token), trained by adamps as Downpour replicas:

    adamps up --torch examples.torch_transformer:Net --train-arg optimizer=adagrad --train-arg lr=0.02

Two encoder layers (d_model 64, 4 heads, feed-forward 128, no dropout), a learned position
embedding, mean pooling over the rows and a linear classifier: 70,000 parameters. Its attention
projections are ``nn.MultiheadAttention``'s own parameters (dense gradients); the feed-forward,
input and output ``nn.Linear`` layers push activation and error vectors where that is smaller.
"""

from __future__ import annotations

import torch
from torch import nn


class RowTransformer(nn.Module):
    """images [B, 1, 28, 28] -> logits [B, 10]."""

    def __init__(self, d_model: int = 64, heads: int = 4, ff: int = 128, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(28, d_model)
        self.pos = nn.Parameter(torch.randn(28, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True
        )
        # the nested-tensor fast path is for inference with padding masks; plain layers here
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(len(x), 28, 28)
        h = self.encoder(self.embed(rows) + self.pos)
        return self.head(h.mean(dim=1))


def Net() -> nn.Module:  # noqa: N802 - a factory named like the module it returns
    return RowTransformer()
