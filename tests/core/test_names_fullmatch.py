"""Issue 39, finding 10: names are checked whole. A pattern ending in ``$`` matched with
``re.match`` lets one final ``"\\n"`` through (``$`` also matches before a trailing newline), so
tensor and table names could end in a newline. Every name check now uses ``fullmatch`` (or
``\\Z``), and the character checks written with ``str.isalnum``/``isdigit`` take ASCII only."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import make_mocked_request

from adamps import runs
from adamps.checkpoint import series as ckpt_series
from adamps.checkpoint.format import CheckpointError, checked_file
from adamps.layout import LayoutError, TensorSpec
from adamps.tables import TableError, TableSpec
from adamps.wire.protocol import ProtocolError
from controller import fields

BAD = ["w\n", "w\r\n", "\nw", "w\n\n"]


@pytest.mark.parametrize("name", BAD + ["w@v\n"])
def test_a_tensor_name_with_a_newline_is_refused(name: str) -> None:
    with pytest.raises(LayoutError, match="tensor name"):
        TensorSpec(name, (4,))
    TensorSpec("w", (4,))
    TensorSpec("w@v", (4,))


@pytest.mark.parametrize("name", BAD)
def test_a_table_name_with_a_newline_is_refused(name: str) -> None:
    with pytest.raises(TableError, match="table name"):
        TableSpec(name, 4)
    TableSpec("t", 4)


@pytest.mark.parametrize("name", BAD)
def test_a_run_name_with_a_newline_is_refused(name: str) -> None:
    with pytest.raises(runs.RunError):
        runs.check_name(name)
    assert runs.run_of(name.strip() + "..w") == "w"
    assert runs.run_of("w\n..x") is None


def test_a_checkpoint_file_name_with_a_newline_is_no_checkpoint_file(tmp_path: Path) -> None:
    (tmp_path / "bucket-0000.safetensors\n").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="not a checkpoint file"):
        checked_file(tmp_path, "bucket-0000.safetensors\n", {"bytes": 1, "sha256": "0"})


def test_a_series_directory_with_a_newline_is_not_part_of_the_series(tmp_path: Path) -> None:
    (tmp_path / "ckpt-000001-t1").mkdir()
    (tmp_path / "ckpt-000002-t1\n").mkdir()
    (tmp_path / "ckpt-٠٠٠٠٠٣-t1").mkdir()  # Arabic-Indic digits are digits to \d
    assert [p.name for p in ckpt_series.taken(tmp_path)] == ["ckpt-000001-t1"]


@pytest.mark.parametrize("sid", ["ps-1\n", "ps-ｓ", "ps-é"])
def test_a_server_id_outside_ascii_is_refused(sid: str) -> None:
    req = make_mocked_request("GET", "/servers/x", match_info={"id": sid})
    with pytest.raises(ProtocolError, match="server id"):
        fields.server_id(req)
    ok = make_mocked_request("GET", "/servers/x", match_info={"id": "ps-1"})
    assert fields.server_id(ok) == "ps-1"


@pytest.mark.parametrize("addr", ["127.0.0.1:7000\n", "127.0.0.1:٧٠٠٠", "hôst:7000"])
def test_an_address_outside_ascii_is_refused(addr: str) -> None:
    with pytest.raises(ProtocolError, match="host:port"):
        fields.address({"address": addr})
    assert fields.address({"address": "127.0.0.1:7000"}) == "127.0.0.1:7000"
