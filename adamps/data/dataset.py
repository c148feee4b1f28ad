"""What a source loads (dataserver/sources.py, dataserver/ctr.py): a `Dataset`, or a
`SourceError` saying why not (also from adamps/data/clicks.py); and the fixed-seed held-out split
of sources without their own."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


class SourceError(Exception):
    """A source that cannot be used: unknown kind, missing or unreadable file, inconsistent arrays."""


@dataclass
class Dataset:
    """Decoded images (or click logs' rows) of one source. Arrays are C-contiguous and never
    mutated after loading."""

    train_x: np.ndarray  #: uint8 [N, H, W] or [N, H, W, 3]
    train_y: np.ndarray  #: int64 [N]
    test_x: np.ndarray  #: uint8 [M, H, W] or [M, H, W, 3]
    test_y: np.ndarray  #: int64 [M]
    classes: list[str] = field(default_factory=list)  #: class names; label i is classes[i]
    skipped: int = 0  #: corrupt files skipped while decoding an image folder
    description: str = ""  #: the source spec it came from
    #: click logs only (dataserver/ctr.py): int64 [N, fields] categorical ids; x are then the
    #: float32 [N, dense] features
    train_ids: np.ndarray | None = None
    test_ids: np.ndarray | None = None
    #: the first lines skipped as not rows (click logs), each naming the file, line and expectation
    errors: list[str] = field(default_factory=list)

    @property
    def kind(self) -> str:
        """``"ctr"`` (rows of dense features and ids) or ``"images"``."""
        return "ctr" if self.train_ids is not None else "images"

    @property
    def nbytes(self) -> int:
        arrays = (self.train_x, self.train_y, self.test_x, self.test_y)
        ids = (self.train_ids, self.test_ids) if self.train_ids is not None else ()
        return sum(a.nbytes for a in (*arrays, *ids) if a is not None)

    @property
    def image_shape(self) -> tuple[int, ...]:
        return tuple(self.train_x.shape[1:])


def stratified_holdout(y: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean mask of held-out images: round(fraction * count) of each class, by a fixed-seed permutation."""
    if not 0.0 <= fraction < 1.0:
        raise SourceError(f"holdout fraction must be in [0, 1), got {fraction}")
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(y), dtype=bool)
    for label in np.unique(y):
        idx = np.flatnonzero(y == label)
        mask[rng.permutation(idx)[: int(round(fraction * len(idx)))]] = True
    return mask
