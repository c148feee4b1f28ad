"""A consistent cut's write hold (adamps/checkpoint/save_restore.py ``_hold_all``, issue 38
item 7): each server's hold and release go over one connection opened before the first hold,
so the writes are held for two round trips per server, not for threads starting and
connections opening inside the hold."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from adamps.checkpoint.format import CheckpointError
from adamps.checkpoint.save_restore import _hold_all
from adamps.client.rpc import RpcError


class _Rpc:
    """One server's connection as ``Cluster.rpc`` hands it out: one per thread."""

    def __init__(self, url: str, log: list[tuple[str, str, int]], fail: bool) -> None:
        self.url, self.log, self.fail = url, log, fail
        self.thread = threading.get_ident()

    def get_json(self, path: str) -> Any:
        self.log.append((self.url, path, self.thread))
        return {}

    def call(self, op: str, **fields: Any) -> Any:
        assert threading.get_ident() == self.thread, "a connection used from another thread"
        self.log.append((self.url, op, self.thread))
        if op == "ckpt_hold" and self.fail:
            raise RpcError("unavailable", "not now")
        if op == "ckpt_hold":
            return {"positions": {self.url[-1]: [1, 5]}, "drain_ms": 1.0, "copy_ms": 1.0}
        return {"released": True}


class _Cluster:
    def __init__(self, urls: list[str], fail: str = "") -> None:
        self.urls, self.fail = urls, fail
        self.log: list[tuple[str, str, int]] = []
        self.local = threading.local()
        self.opened: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def live_servers(self) -> list[tuple[str, Any]]:
        return [(u, None) for u in self.urls]

    def rpc(self, url: str) -> _Rpc:
        conns = self.local.__dict__.setdefault("conns", {})
        if url not in conns:
            conns[url] = _Rpc(url, self.log, url == self.fail)
            with self.lock:
                self.opened.append((url, threading.get_ident()))
        return conns[url]


def test_each_server_is_held_and_released_on_one_connection_opened_before_the_holds() -> None:
    cluster = _Cluster(["http://s0", "http://s1", "http://s2"])
    held = _hold_all(cluster, 3, 5.0)  # type: ignore[arg-type]
    assert sorted(held["where"]) == [0, 1, 2]
    assert len(cluster.opened) == 3  # one connection per server, no other
    first_hold = min(i for i, (_u, op, _t) in enumerate(cluster.log) if op == "ckpt_hold")
    for url in cluster.urls:
        mine = [(op, t) for u, op, t in cluster.log if u == url]
        assert [op for op, _t in mine] == ["/healthz", "ckpt_hold", "ckpt_release"]
        assert len({t for _op, t in mine}) == 1
        opened_at = next(i for i, (u, op, _t) in enumerate(cluster.log) if u == url)
        assert opened_at < first_hold  # every connection open before any hold


def test_a_failed_hold_releases_every_server_and_names_the_error() -> None:
    cluster = _Cluster(["http://s0", "http://s1", "http://s2"], fail="http://s1")
    with pytest.raises(CheckpointError, match="could not hold writes: .*not now"):
        _hold_all(cluster, 3, 5.0)  # type: ignore[arg-type]
    released = {u for u, op, _t in cluster.log if op == "ckpt_release"}
    assert released == set(cluster.urls)
