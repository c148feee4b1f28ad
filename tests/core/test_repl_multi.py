"""A repl_multi request's results (repl_wire.multi_results): its messages checked in order, then
stepped in order inside one batch (their Ready carried out once, issue 36), one result each, so
that one refused or failing message fails alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from adamps.server.replication.wire import multi_results
from adamps.server.store.shards import StoreError
from adamps.wire.protocol import ProtocolError


async def test_each_message_has_its_own_result_in_order() -> None:
    seen: list[str] = []
    in_batch = [False]

    async def check(item: dict[str, Any]) -> dict[str, Any]:
        assert not in_batch[0], "checks (which may await) run before the batch"
        seen.append("check " + item["op"])
        if item.get("missing"):
            raise StoreError("unknown_tensor", "w is not defined here")
        if item.get("malformed"):
            raise ProtocolError("bad_request", "no field")
        return item

    def step(item: dict[str, Any]) -> dict[str, Any]:
        assert in_batch[0], "every step inside the one batch"
        seen.append("step " + item["op"])
        if item.get("refuse"):
            raise ProtocolError("stale_epoch", "an older epoch")
        return {"n": len(seen)}

    @contextlib.contextmanager
    def batch() -> Iterator[None]:
        assert not in_batch[0]
        in_batch[0] = True
        seen.append("batch")
        yield
        in_batch[0] = False

    items = [
        {"op": "repl_prepare"},
        {"op": "repl_commit", "refuse": True},
        {"op": "repl_snapshot"},  # not allowed inside repl_multi: never handled
        "not a message",
        {"op": "repl_prepare", "missing": True},
        {"op": "repl_prepare", "malformed": True},
        {"op": "repl_ping"},
    ]
    res = (await multi_results({"items": items}, check, step, batch))["results"]
    assert seen == [
        "check repl_prepare", "check repl_commit", "check repl_prepare", "check repl_prepare",
        "check repl_ping", "batch", "step repl_prepare", "step repl_commit", "step repl_ping",
    ]  # fmt: skip
    assert res[0] == {"ok": {"n": 7}}
    assert res[1]["error"]["code"] == "stale_epoch"
    assert res[2]["error"]["code"] == "unknown_op" and "repl_snapshot" in res[2]["error"]["message"]
    assert res[3]["error"]["code"] == "unknown_op"
    assert res[4]["error"]["code"] == "unknown_tensor"
    assert res[5]["error"]["code"] == "bad_request"
    assert res[6] == {"ok": {"n": 9}}


async def test_a_request_without_items_is_refused_whole() -> None:
    async def check(item: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("never called")

    with pytest.raises(ProtocolError):
        await multi_results({}, check, lambda m: m)
