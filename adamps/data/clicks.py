"""Click logs' rows (Criteo's format): per line a label (0 or 1), 13 integer dense features and
26 categorical values (hex strings), tab-separated; an empty dense feature is 0 and an empty
categorical value is ``MISSING_ID`` (0, in every field). A categorical value is hashed with blake2b
of (field index, value) into ids ``1 .. id_space - 1`` of its field: the same string gets the same
id on every machine and in every run, and two fields' equal strings are different ids.

The one reader of the format: the data servers load a click log with it (dataserver/ctr.py), and
`adamps up --torch` checks a click model on a log's first rows (``sample``) before any process
starts. The planted-truth generator's rows (``generator_rows``, adamps/data/ctr_data.py) have the
same columns.
"""

from __future__ import annotations

import functools
import gzip
import hashlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from adamps.data.ctr_data import CtrData, CtrSpec
from adamps.data.dataset import SourceError

N_DENSE = 13  #: Criteo's integer features
N_CATEGORICAL = 26  #: Criteo's categorical features
MISSING_ID = 0  #: the id of an empty categorical value, in every field
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


def generator_rows(examples: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dense, per-field ids, labels int64) of the planted-truth generator's draw `seed`."""
    spec = CtrSpec()
    ids, dense, y, _ = CtrData(spec).dense_examples(examples, seed)
    ids -= np.asarray(spec.offsets, np.int64)  # each field's own ids, as a file's columns
    return dense, ids, y.astype(np.int64)


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
