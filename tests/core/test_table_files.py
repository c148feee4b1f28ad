"""adamps/checkpoint/table_files.py without a cluster: the k-way merge of sorted bucket runs is in id order
and bounded by runs x chunk rows per piece; the streamed safetensors and npy writers produce files
that safetensors, numpy and the loader read back, empty tables included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from adamps.checkpoint.table_files import _merge, _Out, ids_path, read_rows


def test_merge_is_in_id_order_in_bounded_pieces() -> None:
    rng = np.random.default_rng(0)
    every = rng.choice(1 << 40, 5000, replace=False).astype(np.int64) - (1 << 39)
    ids = [np.sort(r) for r in np.array_split(rng.permutation(every), 7)]
    rows = [np.repeat(i[:, None].astype(np.float64), 2, axis=1) for i in ids]
    pieces = list(_merge(ids, rows, 37))
    got = np.concatenate([p for p, _ in pieces])
    assert np.array_equal(got, np.sort(every))
    assert np.array_equal(np.concatenate([r for _, r in pieces])[:, 1], got.astype(np.float64))
    assert max(len(p) for p, _ in pieces) <= 7 * 37


@pytest.mark.parametrize("n", [0, 5])
@pytest.mark.parametrize("fmt", ["safetensors", "npy"])
def test_written_files_read_back(tmp_path: Path, n: int, fmt: str) -> None:
    out = tmp_path / f"t.{fmt}"
    ids = np.arange(n, dtype=np.int64) * 3 - 4
    rows = np.arange(n * 3, dtype=np.float32).reshape(n, 3)
    w = _Out(out, fmt, "t", n, 3)
    for lo in range(0, n, 2):
        w.write(ids[lo : lo + 2], rows[lo : lo + 2])
    w.finish()
    if fmt == "safetensors":
        d = load_file(str(out))
        assert d["ids"].tobytes() == ids.tobytes() and d["rows"].tobytes() == rows.tobytes()
        assert d["rows"].shape == (n, 3)
    else:
        assert np.load(ids_path(out)).tobytes() == ids.tobytes()
        assert np.load(out).shape == (n, 3) and np.load(out).tobytes() == rows.tobytes()
    count, dim, batches = read_rows(out)
    assert (count, dim) == (n, 3)
    got = list(batches(4))
    assert sum(len(i) for i, _ in got) == n
    if n:
        assert np.array_equal(np.concatenate([i for i, _ in got]), ids)
        assert np.array_equal(np.concatenate([r for _, r in got]), rows)


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """Skeptic 17: files `adamps table load` took, or refused with a traceback or a message
    naming no file, before this pass (file, what the message must say)."""
    from safetensors.numpy import save_file

    rows = np.ones((4, 3), np.float32)
    out: dict[str, tuple[Path, str]] = {}
    (tmp / "empty.npy").write_bytes(b"")
    out["empty"] = (tmp / "empty.npy", "not a .npy array of rows")
    np.save(tmp / "ints.npy", np.arange(12).reshape(4, 3))
    out["ints"] = (
        tmp / "ints.npy",
        "expected rows of floats (float32, float16 or float64), got int64",
    )
    nan = rows.copy()
    nan[2, 1] = np.nan
    np.save(tmp / "nan.npy", nan)
    out["nan"] = (tmp / "nan.npy", "row 2 holds a NaN or Inf value")
    np.save(tmp / "huge.npy", np.full((4, 3), 1e300))
    out["huge"] = (tmp / "huge.npy", "row 0 holds a NaN or Inf value (as float32)")
    save_file(
        {"ids": np.arange(4, dtype=np.int64), "rows": rows * 1e13}, str(tmp / "big.safetensors")
    )
    out["big"] = (tmp / "big.safetensors", "expected at most 1e+12")
    save_file({"ids": np.array([3, 1, 3, 0]), "rows": rows}, str(tmp / "twice.safetensors"))
    out["twice"] = (tmp / "twice.safetensors", "id 3 appears more than once")
    np.save(tmp / "twice.npy", rows)
    np.save(tmp / "twice.ids.npy", np.array([7, 7, 1, 2]))
    out["twice_npy"] = (tmp / "twice.npy", "id 7 appears more than once")
    save_file({"ids": np.arange(4, dtype=np.int64), "rows": rows.astype(np.float64)},
              str(tmp / "f64.safetensors"))  # fmt: skip
    out["f64"] = (tmp / "f64.safetensors", "dtype 'F64', not one of ['F32', 'I32', 'I64']")
    return out


@pytest.mark.parametrize(
    "case", ["empty", "ints", "nan", "huge", "big", "twice", "twice_npy", "f64"]
)
def test_a_bad_file_is_refused_naming_it_before_anything_is_sent(tmp_path: Path, case: str) -> None:
    """docs/operations.md, "Loading a table": a bad file is an error naming it and what was
    expected, before anything is sent (read_rows runs before the table is created)."""
    from adamps.checkpoint.table_files import TableFileError

    path, says = _bad_files(tmp_path)[case]
    with pytest.raises(TableFileError) as err:
        read_rows(path)
    assert path.name in str(err.value) and says in str(err.value), str(err.value)
