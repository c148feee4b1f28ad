"""Keyed jagged batches in and keyed pooled rows out: the shapes of TorchRec's
``KeyedJaggedTensor`` and ``KeyedTensor``, for ``EmbeddingBagCollection`` (issue 38 item 4),
without requiring torchrec.

A keyed jagged batch holds, for each key (a feature) and each of the batch's B examples, a
list of ids of any length. They are stored key-major, as torchrec stores them: ``values`` are
the ids of key 0's examples 0 .. B-1, then key 1's, ...; ``lengths`` (``len(keys) * B``) gives
each list's length, or ``offsets`` (one more) their starts; ``weights``, optional, one per id
(pooled as ``per_sample_weights``).

    kjt = KeyedJaggedTensor(["user", "item"], values=torch.tensor([7, 1, 2, 3]),
                            lengths=torch.tensor([1, 1, 2, 0]))
    # user: [7], [1]    item: [2, 3], []

``features`` reads any object with torchrec's methods (``keys()``, ``values()``,
``lengths()`` or ``offsets()``, ``weights_or_none()``): a torchrec ``KeyedJaggedTensor`` where
torchrec is installed, or this module's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _lengths_of(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:] - offsets[:-1]


def _offsets_of(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])


class JaggedTensor:
    """One key's lists: ``values``, ``lengths`` (one per example), ``offsets``, ``weights``."""

    def __init__(
        self,
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
    ) -> None:
        if lengths is None and offsets is None:
            raise ValueError("a JaggedTensor needs lengths or offsets")
        self._values = values
        self._weights = weights
        self._lengths = _lengths_of(offsets) if lengths is None else lengths.long()
        self._offsets = _offsets_of(self._lengths) if offsets is None else offsets.long()

    def values(self) -> torch.Tensor:
        return self._values

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return self._offsets


class KeyedJaggedTensor:
    """A keyed jagged batch (torchrec's constructor and method names; CPU tensors). Checked at
    construction: ValueError naming what does not fit."""

    def __init__(
        self,
        keys: Sequence[str],
        values: torch.Tensor,
        weights: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
        offsets: torch.Tensor | None = None,
        stride: int | None = None,
    ) -> None:
        keys = list(keys)
        if len(set(keys)) != len(keys) or not all(isinstance(k, str) for k in keys):
            raise ValueError(f"keys must be distinct strings, got {keys!r}")
        if not isinstance(values, torch.Tensor) or values.dim() != 1:
            raise ValueError(f"values must be a 1-D tensor of ids, got {type(values).__name__}")
        if (lengths is None) == (offsets is None):
            raise ValueError("give lengths or offsets (one of them)")
        if lengths is None:
            assert offsets is not None
            offsets = offsets.long()
            if offsets.dim() != 1 or not len(offsets) or int(offsets[0]) != 0:
                raise ValueError("offsets must be 1-D and start at 0")
            lengths = _lengths_of(offsets)
        lengths = lengths.long()
        if lengths.dim() != 1 or (len(lengths) and int(lengths.min()) < 0):
            raise ValueError("lengths must be a 1-D tensor of counts >= 0")
        if int(lengths.sum()) != len(values):
            raise ValueError(
                f"the lengths sum to {int(lengths.sum())} ids, but values holds {len(values)}"
            )
        if keys and len(lengths) % len(keys):
            raise ValueError(f"{len(lengths)} lengths do not split into {len(keys)} keys")
        b = len(lengths) // len(keys) if keys else 0
        if stride is not None and stride != b:
            raise ValueError(f"stride {stride} != {b} (len(lengths) / len(keys))")
        if weights is not None and (weights.dim() != 1 or len(weights) != len(values)):
            raise ValueError(f"weights must be 1-D, one per id ({len(values)})")
        self._keys = keys
        self._values = values
        self._weights = weights
        self._lengths = lengths
        self._stride = b

    @classmethod
    def from_lengths_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> KeyedJaggedTensor:
        return cls(keys, values, weights=weights, lengths=lengths)

    @classmethod
    def from_offsets_sync(
        cls,
        keys: Sequence[str],
        values: torch.Tensor,
        offsets: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> KeyedJaggedTensor:
        return cls(keys, values, weights=weights, offsets=offsets)

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> torch.Tensor | None:
        return self._weights

    def lengths(self) -> torch.Tensor:
        return self._lengths

    def offsets(self) -> torch.Tensor:
        return _offsets_of(self._lengths)

    def stride(self) -> int:
        """The batch size B (examples per key)."""
        return self._stride

    def length_per_key(self) -> list[int]:
        """Ids per key."""
        return self._lengths.reshape(len(self._keys), -1).sum(1).tolist() if self._keys else []

    def __getitem__(self, key: str) -> JaggedTensor:
        return self.to_dict()[key]

    def to_dict(self) -> dict[str, JaggedTensor]:
        """key -> its JaggedTensor."""
        return {
            k: JaggedTensor(v, w, lengths=n) for k, (v, n, w) in features(self, self._keys).items()
        }


def features(
    kjt: Any, names: Sequence[str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """feature -> (ids, lengths per example, weights or None) of `names` in a keyed jagged batch
    (torchrec's or this module's, read by their methods only). KeyError naming a missing feature;
    ValueError when the batch does not fit together."""
    for m in ("keys", "values"):
        if not callable(getattr(kjt, m, None)):
            raise TypeError(
                f"expected a KeyedJaggedTensor (keys(), values(), lengths() or offsets()), got "
                f"{type(kjt).__name__}"
            )
    keys = list(kjt.keys())
    values = kjt.values()
    lengths = kjt.lengths() if callable(getattr(kjt, "lengths", None)) else None
    if lengths is None:
        offsets = kjt.offsets() if callable(getattr(kjt, "offsets", None)) else None
        if offsets is None:
            raise TypeError("a KeyedJaggedTensor needs lengths() or offsets()")
        lengths = _lengths_of(offsets.long())
    lengths = lengths.long()
    weights = kjt.weights_or_none() if callable(getattr(kjt, "weights_or_none", None)) else None
    if not keys or len(lengths) % len(keys):
        raise ValueError(f"{len(lengths)} lengths do not split into the keys {keys!r}")
    b = len(lengths) // len(keys)
    per_key = lengths.reshape(len(keys), b)
    starts = [0, *torch.cumsum(per_key.sum(1), 0).tolist()]
    if starts[-1] != len(values):
        raise ValueError(f"the lengths sum to {starts[-1]} ids, but values holds {len(values)}")
    out = {}
    for name in names:
        if name not in keys:
            raise KeyError(f"feature {name!r} is not in the batch's keys {keys}")
        i = keys.index(name)
        s, e = starts[i], starts[i + 1]
        out[name] = (values[s:e], per_key[i], None if weights is None else weights[s:e])
    return out


class KeyedTensor:
    """Pooled rows per key, concatenated along ``key_dim`` (1): what TorchRec's
    EmbeddingBagCollection returns. ``values()`` is ``[B, sum of dims]``; ``to_dict()`` and
    ``kt[key]`` give each key's ``[B, dim]``."""

    def __init__(
        self, keys: Sequence[str], length_per_key: Sequence[int], values: torch.Tensor,
        key_dim: int = 1,
    ) -> None:  # fmt: skip
        self._keys = list(keys)
        self._lengths = [int(n) for n in length_per_key]
        self._values = values
        self._key_dim = key_dim
        if len(self._keys) != len(self._lengths) or values.shape[key_dim] != sum(self._lengths):
            raise ValueError("a KeyedTensor needs one length per key, summing to values' width")

    def keys(self) -> list[str]:
        return list(self._keys)

    def values(self) -> torch.Tensor:
        return self._values

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> list[int]:
        return list(self._lengths)

    def offset_per_key(self) -> list[int]:
        return [0, *torch.cumsum(torch.tensor(self._lengths), 0).tolist()]

    def to_dict(self) -> dict[str, torch.Tensor]:
        parts = self._values.split(self._lengths, dim=self._key_dim)
        return dict(zip(self._keys, parts, strict=True))

    def __getitem__(self, key: str) -> torch.Tensor:
        return self.to_dict()[key]
