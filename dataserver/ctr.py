"""Click logs as a data source (issue 38): rows of (label, dense features, categorical ids).

    ctr           the planted-truth generator (adamps/data/ctr_data.py): ``ctr_examples`` rows of 13
                  dense counts and one id per field (4 fields; column f holds field f's own ids,
                  0 .. sizes[f] - 1), labelled by the planted logistic model
    ctr:FILE      a Criteo-format TSV (``.gz`` read compressed): per line a label (0 or 1), 13
                  integer dense features and 26 categorical values (hex strings), tab-separated

A line's fields, its ids (hashed into ``1 .. ctr_id_space - 1`` per field) and what is not a row:
adamps/data/clicks.py, the one reader of the format (`adamps up --torch` reads a log's first rows
with it too).

The file is read line by line into blocks (never whole into memory) and the rows are held within
``cache_bytes``: a file whose rows do not fit is refused at the line where the bound is crossed
(split it across data servers, or raise the bound). A line that is not a row (wrong number of
fields, a label other than 0/1, a dense feature that is not an integer) is skipped; the first ones
are logged and listed in ``/status`` naming the file, the line and what was expected, and a file
with no good row is refused with the first of them. The held-out split is stratified by label
with the data servers' seed, as for other sources without their own (``holdout``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from adamps.data.clicks import N_CATEGORICAL, N_DENSE, CtrFormatError, Row, generator_rows, rows_of
from adamps.data.dataset import Dataset, SourceError, stratified_holdout

log = logging.getLogger(__name__)

#: bytes of one held row: dense float32, ids int64, label int64 (plus the global index later)
ROW_BYTES = N_DENSE * 4 + N_CATEGORICAL * 8 + 8
BLOCK = 8192  #: rows parsed into Python lists before they become one numpy block
MAX_LOGGED = 10  #: bad lines logged (and listed in /status) per file; the rest are counted


def read_tsv(
    path: Path, id_space: int, max_bytes: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str], int]:
    """(dense float32 [N, 13], ids int64 [N, 26], labels int64 [N], first bad lines' messages,
    bad lines) of a Criteo-format TSV, read line by line into blocks of BLOCK rows."""
    if id_space < 2:
        raise SourceError(f"ctr_id_space must be >= 2 (id 0 is the missing value), got {id_space}")
    blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    block: list[Row] = []
    rows, bad, errors = 0, 0, []

    def flush() -> None:
        if block:
            blocks.append((
                np.array([r[1] for r in block], np.float32),
                np.array([r[2] for r in block], np.int64),
                np.array([r[0] for r in block], np.int64),
            ))  # fmt: skip
            block.clear()

    for lineno, row in rows_of(path, id_space):
        if isinstance(row, CtrFormatError):
            bad += 1
            if len(errors) < MAX_LOGGED:
                errors.append(str(row))
                log.warning("skipping a line that is not a row: %s", row)
            continue
        rows += 1
        if rows * ROW_BYTES > max_bytes:
            raise SourceError(
                f"{path}:{lineno}: the rows so far ({rows}, {ROW_BYTES} bytes each) exceed "
                f"cache_bytes={max_bytes}; raise it or split the file across data servers"
            )
        block.append(row)
        if len(block) >= BLOCK:
            flush()
    flush()
    if not blocks:
        first = f": {errors[0]}" if errors else ""
        raise SourceError(f"click log {path} has no row{first}")
    d, i, y = (np.concatenate([b[k] for b in blocks]) for k in range(3))
    return d, i, y, errors, bad


def load_ctr(
    arg: str, *, holdout: float, seed: int, examples: int, id_space: int, max_bytes: int
) -> Dataset:
    """The ``ctr`` (arg empty: the generator) or ``ctr:FILE`` source as a Dataset whose x are
    the dense features and ``train_ids`` / ``test_ids`` the categorical ids."""
    errors: list[str] = []
    bad = 0
    if not arg:
        if examples < 2 or examples * ROW_BYTES > max_bytes:
            raise SourceError(
                f"ctr: ctr_examples must be >= 2 and its rows ({ROW_BYTES} bytes each) fit "
                f"cache_bytes={max_bytes}, got {examples}"
            )
        dense, ids, y = generator_rows(examples, seed)
    else:
        path = Path(arg)
        if not path.is_file():
            raise SourceError(f"click log {path}: not a file")
        dense, ids, y, errors, bad = read_tsv(path, id_space, max_bytes)
    test = stratified_holdout(y, holdout, seed)
    train = ~test
    ds = Dataset(
        np.ascontiguousarray(dense[train]), np.ascontiguousarray(y[train]),
        np.ascontiguousarray(dense[test]), np.ascontiguousarray(y[test]),
        classes=["0", "1"], skipped=bad,
    )  # fmt: skip
    ds.train_ids = np.ascontiguousarray(ids[train])
    ds.test_ids = np.ascontiguousarray(ids[test])
    ds.errors = errors
    return ds
