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
