"""A restore's streamed reading of a checkpoint (adamps/checkpoint/stream.py, issue 38 item 7): pass 1
hashes every file and bounds every value block by block, pass 2 reads a request's shards into a
reused buffer; what pass 1 did not check is never sent."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from adamps.checkpoint import stream as ckpt_stream
from adamps.checkpoint.format import CheckpointError, write_file, write_manifest
from adamps.checkpoint.restore import _check_stream
from adamps.checkpoint.stream import Stream


def _ckpt(d: Path, values: dict[str, np.ndarray]) -> dict:
    d.mkdir()
    entry = write_file(d / "bucket-0000.safetensors", values)
    shards = {sid: {"file": "bucket-0000.safetensors", "bucket": 0, "epoch": 1, "version": 3,
                    "accum": False, "tensor": "w", "start": 0, "stop": v.size}
              for sid, v in values.items()}  # fmt: skip
    return write_manifest(d, {"n_buckets": 1, "max_shard_elems": 1 << 18, "tables": [],
                              "tensors": [{"name": "w", "shape": [1]}], "consistent": False,
                              "cuts": {"0": {"epoch": 1, "seq": 0}}, "shards": shards,
                              "row_shards": {}, "files": {"bucket-0000.safetensors": entry}})  # fmt: skip


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ckpt_stream, "BLOCK", 64)  # every array spans several blocks


def test_pass_one_sees_every_element_once_and_pass_two_reads_them_back(
    tmp_path: Path, small_blocks: None
) -> None:
    values = {"w/0": np.arange(100, dtype=np.float32), "w/1": np.arange(37, dtype=np.float32)}
    m = _ckpt(tmp_path / "c", values)
    s = Stream(tmp_path / "c", m)
    seen: dict[str, list[np.ndarray]] = {}
    s.check(lambda _f, key, a: seen.setdefault(key, []).append(a.copy()))
    for key, v in values.items():
        assert len(seen[key]) > 1  # in parts, one per block
        assert np.concatenate(seen[key]).tobytes() == v.tobytes()
    got = s.read([s.piece("bucket-0000.safetensors", k, k) for k in values])
    assert [g.tobytes() for g in got] == [v.tobytes() for v in values.values()]


def test_a_nan_in_a_later_block_is_refused_before_anything_is_sent(
    tmp_path: Path, small_blocks: None
) -> None:
    v = np.zeros(100, np.float32)
    v[90] = np.nan
    m = _ckpt(tmp_path / "c", {"w/0": v})
    with pytest.raises(CheckpointError, match="NaN/Inf.*nothing restored"):
        _check_stream(tmp_path / "c", m, Stream(tmp_path / "c", m), set())


def test_a_file_changed_between_the_passes_is_refused(tmp_path: Path) -> None:
    m = _ckpt(tmp_path / "c", {"w/0": np.ones(10, np.float32)})
    s = Stream(tmp_path / "c", m)
    refs, _rows = _check_stream(tmp_path / "c", m, s, set())
    path = tmp_path / "c" / "bucket-0000.safetensors"
    data = bytearray(path.read_bytes())
    data[-4:] = np.float32(np.nan).tobytes()  # same size, other bytes, a later write
    path.write_bytes(bytes(data))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    with pytest.raises(CheckpointError, match="changed since it was checked"):
        s.read([refs["w/0"][0]])


def test_a_checksum_mismatch_and_a_misplaced_shard_are_named(tmp_path: Path) -> None:
    m = _ckpt(tmp_path / "c", {"w/0": np.ones(10, np.float32)})
    path = tmp_path / "c" / "bucket-0000.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="bucket-0000.safetensors: checksum mismatch"):
        _check_stream(tmp_path / "c", m, Stream(tmp_path / "c", m), set())
    m2 = _ckpt(tmp_path / "d", {"w/0": np.ones(10, np.float32)})
    m2["shards"]["w/0"]["stop"] = 11
    with pytest.raises(CheckpointError, match=r"shard 'w/0': 10 values for \[0, 11\)"):
        _check_stream(tmp_path / "d", m2, Stream(tmp_path / "d", m2), set())


def _raw_safetensors(header: dict, data: bytes) -> bytes:
    import json

    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


@pytest.mark.parametrize(
    ("header", "data", "why"),
    [
        # a float32 array starting 2 bytes into its data: a view of it would be misaligned
        ({"w/0": {"dtype": "F32", "shape": [2], "data_offsets": [2, 10]}}, bytes(10), "aligned"),
        ({"w/0": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8), "bytes [0, 8)"),
        ({"w/0": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8), "'F64'"),
    ],
)
def test_load_and_the_streamed_restore_parse_a_header_as_one(
    tmp_path: Path, header: dict, data: bytes, why: str
) -> None:
    """One parser of the safetensors header serves ``load`` and the restore's pass 1: a file
    one refuses, the other refuses with the same words (``load`` took a misaligned array)."""
    from adamps.checkpoint.format import safetensors_views

    blob = _raw_safetensors(header, data)
    path = tmp_path / "bucket-0000.safetensors"
    path.write_bytes(blob)
    with pytest.raises(CheckpointError, match="not a safetensors file") as by_load:
        safetensors_views(np.frombuffer(blob, np.uint8), path)
    stream = Stream(tmp_path, {"files": {}})
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CheckpointError) as by_stream:
            stream._header(fd, path, len(blob), path.name)
    finally:
        os.close(fd)
    assert why in str(by_load.value)
    assert str(by_load.value) == str(by_stream.value)
