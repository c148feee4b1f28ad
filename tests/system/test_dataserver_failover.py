"""Real `adamps dataserver` processes: a server SIGKILLed mid-epoch, the client finishes the epoch
from another one without repeating or skipping an image (Project Adam 3.1 + the issue's failover)."""

from __future__ import annotations

import json
import subprocess
import urllib.request

import numpy as np
import pytest

from adamps.up.procs import adamps_argv, free_port
from dataserver.augment import AugmentParams, augment_images, epoch_transforms
from dataserver.client import DataClient

N, SIDE = 12000, 64  # 49 MB per epoch: far more than loopback socket buffers can hold ahead


@pytest.mark.slow
def test_client_finishes_the_epoch_from_another_server_after_sigkill(
    procs, token, tmp_path
) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (N, SIDE, SIDE), dtype=np.uint8)
    y = rng.integers(0, 10, N).astype(np.int64)
    np.savez(tmp_path / "data.npz", x_train=x, y_train=y, x_test=x[:10], y_test=y[:10])
    ports = [free_port(), free_port()]
    servers = [
        procs.start(f"ds{i}", "dataserver", "--source", f"npz:{tmp_path / 'data.npz'}",
                    "--port", str(p), "--ahead", "0", "--seed", "77")
        for i, p in enumerate(ports)
    ]  # fmt: skip
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    for proc, url in zip(servers, urls, strict=True):
        proc.wait_http(url + "/healthz", timeout=60)

    client = DataClient(urls, token, timeout=10.0, failover_timeout=20.0)
    batches = []
    with client.epoch(replica=0, n_replicas=1, epoch=0, batch_size=64, prefetch=1) as it:
        for b in it:
            batches.append(b)
            if len(batches) == 10:
                assert it.progress.servers == [urls[0]]  # replica 0 starts on the first server
                servers[0].kill()  # SIGKILL the server and its augmentation worker
        assert it.failovers >= 1 and it.progress.servers[-1] == urls[1]

    idx = np.concatenate([b.index for b in batches])
    assert len(idx) == N and len(np.unique(idx)) == N  # nothing repeated, nothing skipped
    assert [b.position for b in batches] == list(range(0, N, 64))
    assert np.array_equal(np.concatenate([b.y for b in batches]), y[idx])
    # the second server computed the very same variants (deterministic in seed, epoch, image)
    t = epoch_transforms(N, 0, 77, AugmentParams())
    for b in (batches[5], batches[-1]):
        assert np.array_equal(b.x, augment_images(x[b.index], t[b.index]))

    with urllib.request.urlopen(urls[1] + "/status", timeout=5) as r:
        status = json.load(r)
    assert status["n_train"] == N and status["fingerprint"]
    assert servers[1].stop() == 0  # SIGTERM: clean exit, worker pool shut down


def test_unknown_source_is_a_clear_error_exit_2(tmp_path) -> None:
    out = subprocess.run(
        adamps_argv("dataserver", "--source", f"npz:{tmp_path / 'missing.npz'}"),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2
    assert "cannot read npz file" in out.stderr and "missing.npz" in out.stderr
