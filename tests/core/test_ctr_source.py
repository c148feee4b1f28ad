"""Click logs as a data source (issue 38, adamps/data/clicks.py, dataserver/ctr.py): Criteo-format TSV rows parsed and
hashed (good rows, empty fields, lines that are not rows named by file and line), the rows'
memory bound, and the planted-truth generator."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest

from adamps.data.clicks import (
    MISSING_ID,
    N_CATEGORICAL,
    N_DENSE,
    CtrFormatError,
    hash_id,
    parse_line,
    sample,
)
from dataserver.ctr import ROW_BYTES, read_tsv
from dataserver.sources import SourceError, load_source

CATS = [f"{i:08x}" for i in range(N_CATEGORICAL)]


def line(label: str = "1", dense: list[str] | None = None, cats: list[str] | None = None) -> str:
    d = dense if dense is not None else [str(i) for i in range(N_DENSE)]
    return "\t".join([label, *d, *(cats if cats is not None else CATS)]) + "\n"


def test_hash_is_stable_per_field_and_within_the_id_space() -> None:
    # pinned: the same string is the same id on every machine, in every version
    assert hash_id(0, "68fd1e64", 1 << 20) == 105082
    assert hash_id(25, "e5ba7672", 1000) == 435
    # the same string in two fields is two ids
    assert hash_id(1, "68fd1e64", 1 << 20) != hash_id(0, "68fd1e64", 1 << 20)
    ids = {hash_id(f, v, 50) for f in range(3) for v in CATS}
    assert min(ids) >= 1 and max(ids) <= 49  # 0 is the missing value's


def test_good_row_and_empty_fields() -> None:
    y, dense, ids = parse_line(line(), "f:1", 1 << 20)
    assert y == 1 and dense == [float(i) for i in range(N_DENSE)]
    assert ids == [hash_id(f, v, 1 << 20) for f, v in enumerate(CATS)]
    empty_dense = [""] * N_DENSE
    empty_cats = ["", *CATS[1:-1], ""]
    y, dense, ids = parse_line(line("0", empty_dense, empty_cats).rstrip("\n") + "\r\n", "f:2", 99)
    assert y == 0 and dense == [0.0] * N_DENSE  # missing dense -> 0
    assert ids[0] == ids[-1] == MISSING_ID and MISSING_ID not in ids[1:-1]
    # negative counts (Criteo's I2) are integers too
    assert parse_line(line(dense=["-1"] + ["2"] * 12), "f:3", 99)[1][0] == -1.0


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("1\t2\t3\n", "expected 40 tab-separated fields (label, 13 integers, 26 categorical"),
        (line(label="2"), "field 1 (the label) must be 0 or 1, got '2'"),
        (line(dense=["1", "x7"] + ["0"] * 11), "field 3 (dense feature I2) must be an integer"),
        (line(dense=["1.5"] + ["0"] * 12), "field 2 (dense feature I1) must be an integer"),
    ],
)
def test_a_line_that_is_not_a_row_names_file_line_and_expectation(text: str, expect: str) -> None:
    with pytest.raises(CtrFormatError) as exc:
        parse_line(text, "day_0.tsv:17", 1 << 20)
    assert str(exc.value).startswith("day_0.tsv:17: ") and expect in str(exc.value)


def test_read_tsv_skips_bad_lines_and_names_them(tmp_path: Path) -> None:
    path = tmp_path / "clicks.tsv"
    path.write_text(line("1") + "\n" + line(label="x") + line("0", [""] * N_DENSE) + "a\tb\n")
    dense, ids, y, errors, bad = read_tsv(path, 1 << 20, 1 << 20)
    assert y.tolist() == [1, 0] and dense.shape == (2, N_DENSE) and ids.shape == (2, 26)
    assert dense.dtype == np.float32 and ids.dtype == np.int64
    assert bad == 2 and len(errors) == 2
    assert errors[0].startswith(f"{path}:3: field 1 (the label)")  # line 2 is blank: skipped
    assert errors[1].startswith(f"{path}:5: expected 40 tab-separated fields")


def test_a_file_without_rows_is_refused_with_the_first_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "test_set.tsv"  # Criteo's test days: no label column
    path.write_text("".join(line()[2:] for _ in range(3)))
    with pytest.raises(SourceError, match=rf"click log {path} has no row: {path}:1: expected 40"):
        load_source(f"ctr:{path}")
    with pytest.raises(SourceError, match="not a file"):
        load_source(f"ctr:{tmp_path / 'missing.tsv'}")


def test_rows_are_held_within_cache_bytes(tmp_path: Path) -> None:
    path = tmp_path / "big.tsv"
    path.write_text(line() * 10)
    with pytest.raises(SourceError, match=rf"{path}:4: the rows so far \(4, {ROW_BYTES} bytes"):
        load_source(f"ctr:{path}", max_bytes=3 * ROW_BYTES + 1)
    assert len(load_source(f"ctr:{path}", max_bytes=10 * ROW_BYTES).train_y) == 8


def test_ctr_file_source_splits_and_reads_gzip(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    text = "".join(
        line(str(rng.integers(2)), [str(v) for v in rng.integers(0, 9, N_DENSE)],
             [f"{v:x}" for v in rng.integers(0, 30, N_CATEGORICAL)])
        for _ in range(200)
    )  # fmt: skip
    (tmp_path / "c.tsv").write_text(text)
    with gzip.open(tmp_path / "c.tsv.gz", "wt") as f:
        f.write(text)
    ds = load_source(f"ctr:{tmp_path / 'c.tsv'}", holdout=0.25, seed=3, ctr_id_space=1000)
    gz = load_source(f"ctr:{tmp_path / 'c.tsv.gz'}", holdout=0.25, seed=3, ctr_id_space=1000)
    assert ds.kind == "ctr" and len(ds.train_y) + len(ds.test_y) == 200
    assert 40 <= len(ds.test_y) <= 60 and ds.test_ids.shape == (len(ds.test_y), 26)
    assert np.array_equal(ds.train_ids, gz.train_ids) and np.array_equal(ds.test_x, gz.test_x)
    assert ds.train_ids.max() < 1000 and ds.train_ids.min() >= 1
    first = sample(f"ctr:{tmp_path / 'c.tsv'}", 5, id_space=1000)
    assert first[0].shape == (5, 13) and first[1].shape == (5, 26) and first[2].shape == (5,)


def test_generator_source_is_deterministic_with_per_field_ids() -> None:
    from adamps.data.ctr_data import CtrSpec

    a = load_source("ctr", ctr_examples=2000, seed=5)
    b = load_source("ctr", ctr_examples=2000, seed=5)
    assert a.kind == "ctr" and len(a.train_y) + len(a.test_y) == 2000
    assert np.array_equal(a.train_ids, b.train_ids) and np.array_equal(a.train_x, b.train_x)
    assert a.train_x.shape[1] == 13 and a.train_ids.shape[1] == CtrSpec().n_fields
    assert (a.train_ids >= 0).all() and (a.train_ids.max(0) < np.array(CtrSpec().sizes)).all()
    assert 0.05 < a.train_y.mean() < 0.6 and (a.train_x >= 0).all()
    with pytest.raises(SourceError, match="ctr_examples must be >= 2"):
        load_source("ctr", ctr_examples=1000, max_bytes=100 * ROW_BYTES)


def test_a_line_without_breaks_is_not_held_whole(tmp_path: Path) -> None:
    """A binary file (or one huge line) is dropped a piece at a time, named by its line."""
    from adamps.data.clicks import MAX_LINE

    path = tmp_path / "mixed.tsv"
    path.write_text(line("1") + "x" * (3 * MAX_LINE + 5) + "\n" + line("0") + "y" * MAX_LINE)
    dense, ids, y, errors, bad = read_tsv(path, 1 << 20, 1 << 20)
    assert y.tolist() == [1, 0] and bad == 2
    assert errors == [f"{path}:{n}: longer than {MAX_LINE} characters" for n in (2, 4)]
