"""``adamps export --table`` and ``adamps table load`` against a real local cluster (controllers
and three parameter servers as processes, RF 3), through the CLI as a user runs them: the export
is in id order and equals pulls of every id, in both formats (checked with numpy and with the
safetensors package); it streams (a checkpoint's table exported under tracemalloc holds a
fraction of the table); export -> load into a new table, from each format and from a
checkpoint, equals the original. The CLI's errors for bad files name the file and what is
expected."""

from __future__ import annotations

import json
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from adamps.checkpoint import table_files
from adamps.checkpoint import table_load as table_cmd
from adamps.checkpoint.export import main as export_main
from adamps.client import ControllerRouting, PartialPushError, PSClient
from adamps.layout import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import TOKEN, running_cluster  # noqa: E402

DIM = 16
ROWS = 100_000
#: buckets of the cluster: the export holds about one bucket's rows (a few copies of it)
BUCKETS = 32
OPT = {"kind": "rowwise_adagrad", "lr": 0.05}


def cli(c, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "adamps", *args,
         "--controllers", ",".join(c.controllers), "--token", TOKEN],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


@pytest.mark.slow
def test_export_is_in_id_order_streams_and_loads_back(tmp_path: Path) -> None:
    with running_cluster(tmp_path / "c", n_servers=3, n_buckets=BUCKETS) as c:
        client = PSClient(
            ControllerRouting(c.controllers), Layout([], n_buckets=BUCKETS), TOKEN, retry_for=60
        )
        client.create_table(
            "emb", DIM, init={"kind": "normal", "std": 0.1, "seed": 1}, optimizer=OPT
        )
        rng = np.random.default_rng(3)
        ids = rng.choice(1 << 50, ROWS, replace=False).astype(np.int64) - (1 << 49)
        for lo in range(0, ROWS, 20_000):
            part = ids[lo : lo + 20_000]
            g = rng.normal(size=(len(part), DIM)).astype(np.float32)
            try:
                client.push_rows("emb", part, g)
            except PartialPushError as exc:  # a slow machine's failover: complete it once
                client.push_rows("emb", part, g, seq=exc.seq)
        order = np.sort(ids)
        want = client.pull_rows("emb", order)

        out = tmp_path / "out"
        r = cli(c, "export", "--table", "emb", "--out", str(out / "emb.safetensors"))
        assert r.returncode == 0, r.stderr
        assert f"wrote {ROWS} rows of table 'emb'" in r.stdout
        st = load_file(str(out / "emb.safetensors"))  # the safetensors package reads it
        assert st["ids"].tobytes() == order.tobytes()
        assert st["rows"].tobytes() == want.tobytes()
        r = cli(c, "export", "--table", "emb", "--format", "npy", "--out", str(out / "emb.npy"))
        assert r.returncode == 0, r.stderr
        assert np.load(out / "emb.ids.npy").tobytes() == order.tobytes()
        assert np.load(out / "emb.npy").tobytes() == want.tobytes()
        assert sorted(p.name for p in out.iterdir()) == [
            "emb.ids.npy",
            "emb.npy",
            "emb.safetensors",
        ]

        # Streamed: the export of a checkpoint's table holds about one bucket (1/32 of the
        # rows) a few times, the merge's chunks (32 runs x 128 rows) and the checksum's 1 MiB
        # buffer, not the table (ids and rows: 72 bytes a row, 7.2 MB): half of it is the bound.
        ckpt = tmp_path / "ckpt"
        r = cli(c, "checkpoint", "save", "--to", str(ckpt))
        assert r.returncode == 0, r.stderr
        tracemalloc.start()
        try:
            n = table_files.export_table(ckpt, "emb", out / "t.safetensors", "safetensors", 128)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        table_bytes = ROWS * (8 + 4 * DIM)
        assert n == ROWS and peak < table_bytes / 2, (peak, table_bytes)
        assert (out / "t.safetensors").read_bytes() == (out / "emb.safetensors").read_bytes()

        # Round trips into new tables: from each format, and from the checkpoint itself.
        loads = [
            ("emb_st", str(out / "emb.safetensors"), []),
            ("emb_npy", str(out / "emb.npy"), []),
            ("emb_ckpt", str(ckpt), ["--source-table", "emb"]),
        ]
        for name, src, extra in loads:
            r = cli(c, "table", "load", "--table", name, "--from", src,
                    "--optimizer", json.dumps(OPT), "--batch", "20000", *extra)  # fmt: skip
            assert r.returncode == 0, r.stderr
            assert f"loaded {ROWS} rows into table {name!r}" in r.stdout
            client.tables[name] = DIM
            assert client.pull_rows(name, order).tobytes() == want.tobytes(), name
        # A dense 2-D .npy: its row index is the id
        np.save(out / "dense.npy", want[:500])
        r = cli(c, "table", "load", "--table", "emb_st", "--from", str(out / "dense.npy"))
        assert r.returncode == 0, r.stderr
        got = client.pull_rows("emb_st", np.arange(500))
        assert got.tobytes() == want[:500].tobytes()
        client.close()


def test_bad_files_are_cli_errors_naming_the_file_and_what_is_expected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked before any cluster is reached (no cluster runs here): the command's main, as
    ``adamps table load`` calls it, exits 1 with the file and what was expected."""
    flat = tmp_path / "flat.npy"
    np.save(flat, np.zeros(5, np.float32))
    text = tmp_path / "rows.csv"
    text.write_text("1,2,3\n")
    bad_st = tmp_path / "bad.safetensors"
    bad_st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    wrong_ids = tmp_path / "w.npy"
    np.save(wrong_ids, np.zeros((3, 2), np.float32))
    np.save(tmp_path / "w.ids.npy", np.arange(4))
    other = tmp_path / "other.safetensors"
    save_file({"weight": np.zeros((2, 2), np.float32)}, str(other))
    cases = [
        (flat, flat, "the rows must be 2-D, got shape [5]"),
        (text, text, "expected a .npy or .safetensors file or a checkpoint directory, got .csv"),
        (tmp_path / "missing.npy", tmp_path / "missing.npy", "no such file"),
        (bad_st, bad_st, "not a safetensors file"),
        (wrong_ids, tmp_path / "w.ids.npy", "expected 3 integer ids (one per row of w.npy)"),
        (other, other, "expected tensors 'ids' and 'rows' (adamps export --table), got ['weight']"),
        (tmp_path, tmp_path / "manifest.json", "no manifest"),
    ]
    for path, named, words in cases:
        argv = ["load", "--table", "t", "--from", str(path), "--controllers", "127.0.0.1:1",
                "--token", TOKEN]  # fmt: skip
        assert table_cmd.main(argv) == 1, path
        err = capsys.readouterr().err
        assert err.startswith(f"adamps table load: {named}") and words in err, (path, err)
    # and through the console script, as a user types it
    r = subprocess.run(
        [sys.executable, "-m", "adamps", "table", "load", "--table", "t", "--from", str(flat),
         "--controllers", "127.0.0.1:1", "--token", TOKEN],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 1 and f"{flat}: the rows must be 2-D" in r.stderr, r.stderr
    argv = [
        "--table",
        "t",
        "--format",
        "npz",
        "--from",
        str(tmp_path),
        "--out",
        str(tmp_path / "x"),
    ]
    assert export_main(argv) == 2
    assert "a table (--table) exports as safetensors, npy" in capsys.readouterr().err


@pytest.mark.slow
def test_a_16_bit_table_survives_a_checkpoint_round_trip_and_exports(tmp_path: Path) -> None:
    """A float16 table (issue 38): its checkpoint restores onto a new cluster as a float16
    table with the same rows, bit for bit, and its export holds those rows (float32 values that
    are each a float16)."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "half.safetensors"
    n = 5_000
    ids = np.random.default_rng(5).choice(1 << 40, n, replace=False).astype(np.int64)
    order = np.sort(ids)
    with running_cluster(tmp_path / "a", n_servers=3, n_buckets=8) as a:
        client = PSClient(
            ControllerRouting(a.controllers), Layout([], n_buckets=8), TOKEN, retry_for=60
        )
        client.create_table("half", DIM, init={"kind": "normal", "std": 0.1, "seed": 2},
                            optimizer=OPT, dtype="float16")  # fmt: skip
        g = np.random.default_rng(6).normal(size=(n, DIM)).astype(np.float32)
        client.push_rows("half", ids, g)
        want = client.pull_rows("half", order)
        assert want.tobytes() == want.astype(np.float16).astype(np.float32).tobytes()
        client.close()
        r = cli(a, "checkpoint", "save", "--to", str(ckpt))
        assert r.returncode == 0, r.stderr
        r = cli(a, "export", "--table", "half", "--out", str(out))
        assert r.returncode == 0, r.stderr
    st = load_file(str(out))
    assert st["ids"].tobytes() == order.tobytes() and st["rows"].tobytes() == want.tobytes()
    with running_cluster(tmp_path / "b", n_servers=3, n_buckets=8) as b:
        r = cli(b, "checkpoint", "restore", "--from", str(ckpt))
        assert r.returncode == 0, r.stderr
        client = PSClient(
            ControllerRouting(b.controllers), Layout([], n_buckets=8), TOKEN, retry_for=60
        )
        try:
            tables = client._rpc(f"http://{b.servers[0]}").call("list_tables")["tables"]
            assert [t["dtype"] for t in tables if t["name"] == "half"] == ["float16"], tables
            client.tables["half"] = DIM
            assert client.pull_rows("half", order).tobytes() == want.tobytes()
        finally:
            client.close()
