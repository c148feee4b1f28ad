"""Fixtures of the PyTorch tests: a real standalone `adamps ps` on loopback."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adamps.up.procs import free_port

pytest.importorskip("torch", reason="adamps.torch needs torch: pip install -e '.[torch]'")


@pytest.fixture
def ps_url(procs, tmp_path) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """A standalone parameter server (every bucket, no controllers) with its data plane."""
    port = free_port()
    ps = procs.start("ps", "ps", "--port", str(port), "--data-dir", str(tmp_path / "ps"),
                     "--no-lmdb-sync")  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    ps.wait_http(url + "/healthz", 60)
    yield url
