import gzip
import logging

import numpy as np
import pytest
from PIL import Image

from dataserver.sources import SourceError, builtin_mnist, load_source


def test_builtin_mnist_split_is_stratified_and_deterministic():
    train_x, train_y, test_x, test_y = builtin_mnist()
    assert train_x.shape == (4000, 28, 28) and train_x.dtype == np.uint8
    assert train_y.shape == (4000,) and train_y.dtype == np.int64
    assert test_x.shape == (1000, 28, 28) and test_x.dtype == np.uint8
    assert test_y.shape == (1000,) and test_y.dtype == np.int64
    assert np.bincount(train_y).tolist() == [400] * 10
    assert np.bincount(test_y).tolist() == [100] * 10
    assert train_x.max() == 255 and train_x.mean() > 10  # real digits, not blanks
    again = builtin_mnist()
    assert np.array_equal(again[0], train_x) and np.array_equal(again[3], test_y)
    # No held-out image is also a training image.
    train_rows = {row.tobytes() for row in train_x.reshape(4000, -1)}
    assert not any(row.tobytes() in train_rows for row in test_x.reshape(1000, -1))


# ------------------------------------------------------------------ files the tests make


def write_idx(path, arr: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, arr.ndim]) + np.asarray(arr.shape, dtype=">u4").tobytes()
    data = header + arr.astype(np.uint8).tobytes()
    if str(path).endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        path.write_bytes(data)


def small_images(n: int, h: int = 8, w: int = 6, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, h, w), dtype=np.uint8), np.arange(n, dtype=np.int64) % 3


@pytest.mark.parametrize("gz", [False, True])
def test_mnist_idx_with_test_split(tmp_path, gz) -> None:
    suffix = ".gz" if gz else ""
    tx, ty = small_images(12)
    vx, vy = small_images(5, seed=1)
    write_idx(tmp_path / f"train-images-idx3-ubyte{suffix}", tx)
    write_idx(tmp_path / f"train-labels-idx1-ubyte{suffix}", ty)
    write_idx(tmp_path / f"t10k-images-idx3-ubyte{suffix}", vx)
    write_idx(tmp_path / f"t10k-labels-idx1-ubyte{suffix}", vy)
    for spec in (f"mnist:{tmp_path}", str(tmp_path)):  # explicit kind, and guessed from the files
        ds = load_source(spec)
        assert np.array_equal(ds.train_x, tx) and np.array_equal(ds.train_y, ty)
        assert np.array_equal(ds.test_x, vx) and np.array_equal(ds.test_y, vy)
        assert ds.train_y.dtype == np.int64 and ds.skipped == 0


def test_mnist_idx_without_test_split_holds_out_per_class(tmp_path) -> None:
    tx, ty = small_images(30)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", tx)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", ty)
    ds = load_source(f"mnist:{tmp_path}", holdout=0.2)
    assert len(ds.test_y) == 6 and np.bincount(ds.test_y).tolist() == [2, 2, 2]
    assert len(ds.train_y) == 24
    # every image is in exactly one split
    rows = sorted(r.tobytes() for r in np.concatenate([ds.train_x, ds.test_x]))
    assert rows == sorted(r.tobytes() for r in tx)


def test_mnist_idx_bad_files_are_clear_errors(tmp_path) -> None:
    tx, ty = small_images(4)
    write_idx(tmp_path / "train-images-idx3-ubyte", tx)
    with pytest.raises(SourceError, match="train-labels"):
        load_source(f"mnist:{tmp_path}")
    write_idx(tmp_path / "train-labels-idx1-ubyte", ty[:3])
    with pytest.raises(SourceError, match="4 images but"):
        load_source(f"mnist:{tmp_path}")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(b"\x08\x03garbage")
    with pytest.raises(SourceError, match="magic"):
        load_source(f"mnist:{tmp_path}")
    (tmp_path / "train-labels-idx1-ubyte").write_bytes(bytes([0, 0, 8, 1, 0, 0, 0, 9, 1, 2]))
    with pytest.raises(SourceError, match="needs 9"):
        load_source(f"mnist:{tmp_path}")
    (tmp_path / "train-labels-idx1-ubyte").unlink()
    (tmp_path / "train-labels-idx1-ubyte.gz").write_bytes(b"not gzip at all")
    with pytest.raises(SourceError, match="cannot read"):
        load_source(f"mnist:{tmp_path}")


def test_npz_source(tmp_path) -> None:
    tx, ty = small_images(10)
    vx, vy = small_images(4, seed=2)
    np.savez(tmp_path / "d.npz", x_train=tx, y_train=ty, x_test=vx, y_test=vy)
    ds = load_source(f"npz:{tmp_path / 'd.npz'}")
    assert np.array_equal(ds.train_x, tx) and np.array_equal(ds.test_y, vy)
    # floats in [0, 1] and flattened square rows are accepted; no test arrays -> held-out split
    flat = (tx[:, :6, :6].reshape(10, 36) / 255.0).astype(np.float32)
    np.savez(tmp_path / "f.npz", x_train=flat, y_train=ty)
    ds = load_source(str(tmp_path / "f.npz"))
    assert ds.train_x.shape[1:] == (6, 6) and ds.train_x.dtype == np.uint8
    assert len(ds.train_y) + len(ds.test_y) == 10 and len(ds.test_y) > 0
    assert np.array_equal(
        np.sort(np.concatenate([ds.train_x, ds.test_x]).reshape(10, -1), axis=0),
        np.sort(tx[:, :6, :6].reshape(10, -1), axis=0),
    )


def test_npz_bad_content_is_a_clear_error(tmp_path) -> None:
    tx, ty = small_images(4)
    np.savez(tmp_path / "a.npz", images=tx)
    with pytest.raises(SourceError, match="x_train and y_train"):
        load_source(f"npz:{tmp_path / 'a.npz'}")
    np.savez(tmp_path / "b.npz", x_train=tx, y_train=ty[:2])
    with pytest.raises(SourceError, match="does not match"):
        load_source(f"npz:{tmp_path / 'b.npz'}")
    np.savez(tmp_path / "c.npz", x_train=tx.astype(np.float32) * 3, y_train=ty)
    with pytest.raises(SourceError, match="outside"):
        load_source(f"npz:{tmp_path / 'c.npz'}")
    (tmp_path / "d.npz").write_bytes(b"PK garbage")
    with pytest.raises(SourceError, match="cannot read"):
        load_source(f"npz:{tmp_path / 'd.npz'}")


def make_folder(
    root, classes, per_class, size=(6, 8), fmt="PNG", seed=0
) -> dict[str, list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    made: dict[str, list[np.ndarray]] = {}
    for c in classes:
        (root / c).mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            arr = rng.integers(0, 256, (size[1], size[0]), dtype=np.uint8)
            Image.fromarray(arr, "L").save(root / c / f"{i}.{fmt.lower()}", fmt)
            made.setdefault(c, []).append(arr)
    return made


def test_image_folder_with_train_and_test(tmp_path) -> None:
    train = make_folder(tmp_path / "train", ["cat", "dog"], 3)
    make_folder(tmp_path / "test", ["cat", "dog"], 1, seed=1)
    ds = load_source(f"folder:{tmp_path}")
    assert ds.classes == ["cat", "dog"]
    assert ds.train_x.shape == (6, 8, 6) and ds.test_x.shape == (2, 8, 6)
    assert ds.train_y.tolist() == [0, 0, 0, 1, 1, 1] and ds.test_y.tolist() == [0, 1]
    assert np.array_equal(ds.train_x[3], train["dog"][0])  # PNG is lossless


def test_image_folder_skips_corrupt_images(tmp_path, caplog) -> None:
    make_folder(tmp_path, ["a", "b", "c"], 5, fmt="JPEG")
    (tmp_path / "b" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a png")
    (tmp_path / "c" / "empty.jpg").write_bytes(b"")
    (tmp_path / "c" / "notes.txt").write_text("not an image: ignored, not counted")
    # a different size is resized to the first image's size
    Image.fromarray(np.zeros((16, 12), np.uint8), "L").save(tmp_path / "a" / "big.png")
    with caplog.at_level(logging.WARNING):
        ds = load_source(str(tmp_path), holdout=0.2)
    assert ds.skipped == 2
    assert "broken.png" in caplog.text and "empty.jpg" in caplog.text
    assert len(ds.train_y) + len(ds.test_y) == 16
    assert ds.train_x.shape[1:] == (8, 6)
    assert np.bincount(ds.test_y).tolist() == [1, 1, 1]


def test_image_folder_colour(tmp_path) -> None:
    (tmp_path / "x").mkdir()
    Image.fromarray(np.full((4, 5, 3), (10, 20, 30), np.uint8), "RGB").save(
        tmp_path / "x" / "0.png"
    )
    Image.fromarray(np.full((4, 5, 3), (1, 2, 3), np.uint8), "RGB").save(tmp_path / "x" / "1.png")
    ds = load_source(f"folder:{tmp_path}", color=True, holdout=0.0)
    assert ds.train_x.shape == (2, 4, 5, 3) and ds.train_x[0, 0, 0].tolist() == [10, 20, 30]


def test_unknown_or_missing_sources_are_clear_errors(tmp_path) -> None:
    with pytest.raises(SourceError, match="unknown source"):
        load_source("imagenet:/nowhere")
    with pytest.raises(SourceError, match="unknown source"):
        load_source(str(tmp_path / "missing"))
    (tmp_path / "file.csv").write_text("1,2,3")
    with pytest.raises(SourceError, match="not a .npz file or a directory"):
        load_source(str(tmp_path / "file.csv"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no class sub-directories"):
        load_source(f"folder:{tmp_path / 'empty'}")
    with pytest.raises(SourceError, match="not a directory"):
        load_source(f"mnist:{tmp_path / 'file.csv'}")


def test_builtin_spec() -> None:
    ds = load_source("builtin")
    assert ds.train_x.shape == (4000, 28, 28) and ds.classes[9] == "9"
