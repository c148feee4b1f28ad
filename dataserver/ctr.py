"""Click logs as a data source (issue 38): rows of (label, dense features, categorical ids).

    ctr           the planted-truth generator (dataserver/ctr_data.py): ``ctr_examples`` rows of 13
                  dense counts and one id per field (4 fields; column f holds field f's own ids,
                  0 .. sizes[f] - 1), labelled by the planted logistic model
    ctr:FILE      a Criteo-format TSV (``.gz`` read compressed): per line a label (0 or 1), 13
                  integer dense features and 26 categorical values (hex strings), tab-separated

In a file an empty dense feature is 0 and an empty categorical value is ``MISSING_ID`` (0, in
every field). A categorical value is hashed with blake2b of (field index, value) into ids
``1 .. ctr_id_space - 1`` of its field: the same string gets the same id on every machine and in
every run, and two fields' equal strings are different ids.

The file is read line by line into blocks (never whole into memory) and the rows are held within
``cache_bytes``: a file whose rows do not fit is refused at the line where the bound is crossed
(split it across data servers, or raise the bound). A line that is not a row (wrong number of
fields, a label other than 0/1, a dense feature that is not an integer) is skipped; the first ones
are logged and listed in ``/status`` naming the file, the line and what was expected, and a file
with no good row is refused with the first of them. The held-out split is stratified by label
with the data servers' seed, as for other sources without their own (``holdout``).
"""

from __future__ import annotations

import functools
import gzip
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from dataserver.dataset import Dataset, SourceError, stratified_holdout

log = logging.getLogger(__name__)

N_DENSE = 13  #: Criteo's integer features
N_CATEGORICAL = 26  #: Criteo's categorical features
MISSING_ID = 0  #: the id of an empty categorical value, in every field
#: bytes of one held row: dense float32, ids int64, label int64 (plus the global index later)
ROW_BYTES = N_DENSE * 4 + N_CATEGORICAL * 8 + 8
BLOCK = 8192  #: rows parsed into Python lists before they become one numpy block
MAX_LOGGED = 10  #: bad lines logged (and listed in /status) per file; the rest are counted
#: characters of a line read at once: a row is about 300; a longer line (a binary file without
#: line breaks) is not a row and is dropped a piece at a time, never held whole
MAX_LINE = 1 << 16


class CtrFormatError(ValueError):
    """A line of a click log that is not a row; the message names the file, line and expectation."""


# Criteo's values repeat heavily: most lookups hit the cache (bounded: about 10 MB)
@functools.lru_cache(maxsize=1 << 16)
def hash_id(field: int, value: str, id_space: int) -> int:
    """The id of categorical `value` in field `field`: stable, in ``1 .. id_space - 1``."""
    digest = hashlib.blake2b(f"{field}\t{value}".encode(), digest_size=8).digest()
    return 1 + int.from_bytes(digest, "little") % (id_space - 1)


def parse_line(line: str, where: str, id_space: int) -> tuple[int, list[float], list[int]]:
    """(label, 13 dense values, 26 ids) of one TSV line; CtrFormatError naming `where` (file:line)."""
    parts = line.rstrip("\r\n").split("\t")
    n = 1 + N_DENSE + N_CATEGORICAL
    if len(parts) != n:
        raise CtrFormatError(
            f"{where}: expected {n} tab-separated fields (label, {N_DENSE} integers, "
            f"{N_CATEGORICAL} categorical values), got {len(parts)}"
        )
    if parts[0] not in ("0", "1"):
        raise CtrFormatError(f"{where}: field 1 (the label) must be 0 or 1, got {parts[0]!r}")
    dense = []
    for i, v in enumerate(parts[1 : 1 + N_DENSE]):
        try:
            dense.append(float(int(v)) if v else 0.0)
        except ValueError:
            raise CtrFormatError(
                f"{where}: field {i + 2} (dense feature I{i + 1}) must be an integer or empty, "
                f"got {v[:40]!r}"
            ) from None
    ids = [hash_id(f, v, id_space) if v else MISSING_ID for f, v in enumerate(parts[1 + N_DENSE :])]
    return int(parts[0]), dense, ids


Row = tuple[int, list[float], list[int]]  #: (label, dense values, ids) of one line


def rows_of(path: Path, id_space: int) -> Iterator[tuple[int, Row | CtrFormatError]]:
    """(line number, its row or the CtrFormatError saying why it is not one) of each non-blank
    line of `path`, read a line at a time; a line longer than MAX_LINE characters is not a row
    (and is never held whole). SourceError when the file cannot be read."""
    try:
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rt", encoding="utf-8", errors="replace", newline="") as f:
            lineno = 0
            while line := f.readline(MAX_LINE):
                lineno += 1
                where = f"{path}:{lineno}"
                if len(line) >= MAX_LINE and not line.endswith("\n"):
                    while (rest := f.readline(MAX_LINE)) and not rest.endswith("\n"):
                        pass  # the rest of the line, dropped a piece at a time
                    yield lineno, CtrFormatError(f"{where}: longer than {MAX_LINE} characters")
                elif line.strip():
                    try:
                        yield lineno, parse_line(line, where, id_space)
                    except CtrFormatError as exc:
                        yield lineno, exc
    except (OSError, EOFError, UnicodeError) as exc:
        raise SourceError(f"cannot read click log {path}: {exc}") from exc


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


def generator_rows(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, per-field ids, labels int64) of the planted-truth generator's draw `seed`."""
    from dataserver.ctr_data import CtrData, CtrSpec

    spec = CtrSpec()
    ids, dense, y, _ = CtrData(spec).dense_examples(examples, seed)
    ids -= np.asarray(spec.offsets, np.int64)  # each field's own ids, as a file's columns
    return dense, ids, y.astype(np.int64)


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


def sample(source: str, n: int, *, id_space: int = 1 << 20) -> tuple[np.ndarray, ...]:
    """(dense, ids, labels) of the first `n` rows of `source` (``ctr`` or ``ctr:FILE``): what
    ``adamps up --torch`` checks a click model on before any process starts."""
    _, _, arg = source.partition(":")
    if not arg:
        return generator_rows(max(2, n), 0)
    rows: list[Row] = []
    for _, row in rows_of(Path(arg), id_space):
        if len(rows) >= n:
            break
        if not isinstance(row, CtrFormatError):  # the data server skips it too
            rows.append(row)
    if not rows:
        raise SourceError(f"click log {arg} has no row")
    return (
        np.array([r[1] for r in rows], np.float32),
        np.array([r[2] for r in rows], np.int64),
        np.array([r[0] for r in rows], np.int64),
    )
