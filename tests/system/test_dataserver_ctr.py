"""Click logs served by a real `adamps dataserver` process (issue 38): `--source ctr:FILE` streams
every row of a Criteo-format TSV once per epoch, its ids those of the file's strings, with lines
that are not rows skipped and named in /status; `--source ctr` streams the planted-truth
generator; a file with no row is a one-line error naming the file and line (exit 2)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import numpy as np
import pytest

from adamps.data.clicks import N_CATEGORICAL, N_DENSE, parse_line
from adamps.up.procs import adamps_argv, free_port
from dataserver.client import DataClient, DataServerError
from dataserver.sources import load_source

ROWS = 300


def tsv_lines(n: int) -> list[str]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        dense = [str(v) if v < 20 else "" for v in rng.integers(0, 25, N_DENSE)]
        cats = [f"{v:08x}" if v < 40 else "" for v in rng.integers(0, 45, N_CATEGORICAL)]
        out.append("\t".join([str(rng.integers(2)), *dense, *cats]) + "\n")
    return out


def status(url: str) -> dict:
    with urllib.request.urlopen(url + "/status", timeout=5) as r:
        return json.load(r)


@pytest.mark.slow
def test_dataserver_streams_a_click_log(procs, token, tmp_path) -> None:
    lines = tsv_lines(ROWS)
    lines.insert(10, "1\tnot\ta\trow\n")  # file line 11
    path = tmp_path / "clicks.tsv"
    path.write_text("".join(lines))
    port = free_port()
    proc = procs.start("ds", "dataserver", "--source", f"ctr:{path}", "--port", str(port),
                       "--ctr-id-space", "5000", "--seed", "9")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz", timeout=60)

    st = status(url)
    assert st["kind"] == "ctr" and st["n_dense"] == 13 and st["n_fields"] == 26
    assert st["n_train"] + st["n_test"] == ROWS and st["skipped_files"] == 1
    assert st["source_errors"] == [f"{path}:11: expected 40 tab-separated fields (label, 13 "
                                   "integers, 26 categorical values), got 4"]  # fmt: skip
    assert not st["augment"]  # rows are never augmented

    # what the server holds, row by row, as the module parses the file
    ds = load_source(f"ctr:{path}", seed=9, ctr_id_space=5000)
    client = DataClient([url], token)
    with client.epoch(0, 1, 1, batch_size=64) as it:
        batches = list(it)
    idx = np.concatenate([b.index for b in batches])
    assert sorted(idx.tolist()) == list(range(st["n_train"]))  # every row once
    ids = np.concatenate([b.ids for b in batches])
    dense = np.concatenate([b.x for b in batches])
    assert ids.dtype == np.int64 and ids.shape == (st["n_train"], 26)
    assert dense.dtype == np.float32 and dense.shape == (st["n_train"], 13)
    assert np.array_equal(ids, ds.train_ids[idx]) and np.array_equal(dense, ds.train_x[idx])
    assert np.array_equal(np.concatenate([b.y for b in batches]), ds.train_y[idx])
    # and those are the file's rows: each served row is one of the file's lines, parsed
    good = [parse_line(x, "", 5000) for x in lines if x.count("\t") == 39]
    file_rows = {(y, tuple(d), tuple(i)) for y, d, i in good}
    for k in range(0, len(idx), 37):
        row = (int(ds.train_y[idx[k]]), tuple(dense[k]), tuple(ids[k]))
        assert row in file_rows
    with client.epoch(0, 1, 0, batch_size=1000, split="test") as it:
        test = list(it)
    assert sum(len(b.y) for b in test) == st["n_test"] and test[0].ids.shape[1] == 26

    # a bad stream request is refused; the server keeps serving
    with pytest.raises(DataServerError, match="HTTP 400 bad_request: batch_size"):
        with client.epoch(0, 1, 1, batch_size=0) as it:
            list(it)
    assert status(url)["n_train"] == st["n_train"]
    assert proc.stop() == 0


@pytest.mark.slow
def test_dataserver_streams_the_generator(procs, token) -> None:
    port = free_port()
    proc = procs.start("ds", "dataserver", "--source", "ctr", "--port", str(port),
                       "--ctr-examples", "5000")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    proc.wait_http(url + "/healthz", timeout=60)
    st = status(url)
    assert st["kind"] == "ctr" and st["n_train"] + st["n_test"] == 5000 and st["n_fields"] == 4
    with DataClient([url], token).epoch(0, 1, 2, batch_size=500) as it:
        b = next(it)
    assert b.x.shape == (500, 13) and b.ids.shape == (500, 4) and set(b.y.tolist()) <= {0, 1}
    assert proc.stop() == 0


def test_a_click_log_without_rows_is_a_clear_error_exit_2(tmp_path) -> None:
    path = tmp_path / "bad.tsv"
    path.write_text("1\t2\n")
    out = subprocess.run(
        adamps_argv("dataserver", "--source", f"ctr:{path}"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert f"click log {path} has no row: {path}:1: expected 40 tab-separated" in out.stderr
