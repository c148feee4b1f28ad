"""`adamps train --compress` with real processes (1 parameter server, 1 data server, 1 replica,
2 epochs on the built-in data): Strom's compressed pushes train adam-mnist, the server applies
them as compressed updates, and the trainer reports what compression did."""

from __future__ import annotations

import re
import urllib.request

import pytest

from adamps.up.procs import free_port

pytestmark = pytest.mark.slow


def get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.read().decode()


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in metrics"
    return float(m.group(1))


@pytest.mark.timeout(120)
def test_compressed_training_reaches_accuracy_with_few_bytes(procs, tmp_path) -> None:
    ps_port, ds_port = free_port(), free_port()
    ps = procs.start("ps", "ps", "--port", str(ps_port), "--data-dir", str(tmp_path / "ps"),
                     "--no-lmdb-sync")  # fmt: skip
    ds = procs.start("ds", "dataserver", "--port", str(ds_port), "--no-augment")
    ps_url, ds_url = f"http://127.0.0.1:{ps_port}", f"http://127.0.0.1:{ds_port}"
    ps.wait_http(ps_url + "/healthz", 60)
    ds.wait_http(ds_url + "/healthz", 60)
    tr = procs.start("train", "train", "--ps", ps_url, "--dataservers", ds_url, "--epochs", "2",
                     "--metrics-port", "-1", "--compress", "--compress-fraction", "0.01",
                     "--compress-coding", "words")  # fmt: skip
    assert tr.popen.wait(100) == 0, tr.tail()
    summary = tr.summary()
    assert summary["heldout_accuracy"]["2"] >= 0.90, summary
    assert 0.009 < summary["sent_fraction"] < 0.02, summary
    # words: 4 bytes per sent element + 4 per shard; far below the ~7 KB/image uncompressed
    assert summary["bytes_pushed"] / summary["images"] < 600, summary
    text = get(ps_url + "/metrics")
    assert metric(text, "adamps_ps_updates_applied_total", '{kind="compressed"}') > 0
    assert 'adamps_ps_updates_applied_total{kind="fc"}' not in text  # compressed was smaller
