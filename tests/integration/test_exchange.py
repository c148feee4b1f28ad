"""The exchange between partitions (trainer/exchange.py) on loopback, partitions as threads:
the collectives' results, the token check, and a stranger that cannot hold up the mesh."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from adamps.up.procs import free_port
from trainer.exchange import Exchange, connect_mesh


def _ports(n: int) -> list[int]:
    """n distinct ports, free a moment ago, below the ephemeral range (adamps.up.procs.free_port:
    an outgoing connection cannot take one before a partition listens on it)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port()
        if port not in out:
            out.append(port)
    return out


def _mesh(parts: int, transport: str, tokens: list[str], timeout: float = 10.0):
    addrs = [f"127.0.0.1:{p}" for p in _ports(parts)]
    results: dict[int, object] = {}

    def run(k: int) -> None:
        try:
            results[k] = connect_mesh(k, addrs, 0, transport, tokens[k], 1 << 16, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - inspected by the test
            results[k] = exc

    threads = [threading.Thread(target=run, args=(k,)) for k in range(parts)]
    for t in threads:
        t.start()
    return addrs, threads, results


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_all_gather_and_reduce_scatter(transport):
    parts = 3
    _addrs, threads, results = _mesh(parts, transport, ["t"] * parts)
    for t in threads:
        t.join(20)
    ranges = [(0, 2), (2, 5), (5, 7)]
    rng = np.random.default_rng(0)
    partials = [rng.standard_normal((4, 3, 7)).astype(np.float32) for _ in range(parts)]
    got: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def work(k: int) -> None:
        ex = Exchange(k, parts, results[k])
        lo, hi = ranges[k]
        whole = np.empty((4, 3, 7), np.float32)
        for _ in range(3):  # the links are reused in order
            ex.all_gather(partials[0][..., lo:hi] + k, whole, ranges)
            mine = np.empty((4, 3, hi - lo), np.float32)
            ex.reduce_scatter(partials[k], mine, ranges)
        got[k] = (whole, mine)
        ex.close()

    workers = [threading.Thread(target=work, args=(k,)) for k in range(parts)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(20)
    want_whole = np.concatenate(
        [partials[0][..., lo:hi] + k for k, (lo, hi) in enumerate(ranges)], axis=-1
    )
    total = sum(partials)
    for k, (lo, hi) in enumerate(ranges):
        np.testing.assert_allclose(got[k][0], want_whole)
        np.testing.assert_allclose(got[k][1], total[..., lo:hi], rtol=1e-6)


@pytest.mark.timeout(30)
def test_a_wrong_token_is_refused():
    _addrs, threads, results = _mesh(2, "tcp", ["right", "wrong"], timeout=2.0)
    for t in threads:
        t.join(20)
    assert isinstance(results[1], PermissionError)
    assert isinstance(results[0], TimeoutError)


@pytest.mark.timeout(30)
def test_a_silent_stranger_does_not_hold_up_the_mesh():
    addrs = [f"127.0.0.1:{p}" for p in _ports(2)]
    results: dict[int, object] = {}

    def run(k: int) -> None:
        results[k] = connect_mesh(k, addrs, 0, "tcp", "t", 1 << 16, timeout=20)

    t0 = threading.Thread(target=run, args=(0,))
    t0.start()
    port = int(addrs[0].rsplit(":", 1)[1])
    deadline = time.monotonic() + 10
    while True:  # connects first and says nothing
        try:
            stranger = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    t1 = threading.Thread(target=run, args=(1,))
    start = time.monotonic()
    t1.start()
    t0.join(15)
    t1.join(15)
    stranger.close()
    assert set(results) == {0, 1} and time.monotonic() - start < 10
    for links in results.values():
        for link in links.values():
            link.close()
