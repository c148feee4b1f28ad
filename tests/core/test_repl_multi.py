"""A repl_multi request's results (repl_wire.multi_results): its messages handled in order, one
result each, so that one refused or failing message fails alone."""

from __future__ import annotations

from typing import Any

import pytest

from adamps.server.replication.wire import multi_results
from adamps.server.store.shards import StoreError
from adamps.wire.protocol import ProtocolError


async def test_each_message_has_its_own_result_in_order() -> None:
    seen: list[str] = []

    async def handle(item: dict[str, Any]) -> dict[str, Any]:
        seen.append(item["op"])
        if item.get("refuse"):
            raise ProtocolError("stale_epoch", "an older epoch")
        if item.get("missing"):
            raise StoreError("unknown_tensor", "w is not defined here")
        return {"n": len(seen)}

    items = [
        {"op": "repl_prepare"},
        {"op": "repl_commit", "refuse": True},
        {"op": "repl_snapshot"},  # not allowed inside repl_multi: never handled
        "not a message",
        {"op": "repl_prepare", "missing": True},
        {"op": "repl_ping"},
    ]
    res = (await multi_results({"items": items}, handle))["results"]
    assert seen == ["repl_prepare", "repl_commit", "repl_prepare", "repl_ping"]
    assert res[0] == {"ok": {"n": 1}}
    assert res[1]["error"]["code"] == "stale_epoch"
    assert res[2]["error"]["code"] == "unknown_op" and "repl_snapshot" in res[2]["error"]["message"]
    assert res[3]["error"]["code"] == "unknown_op"
    assert res[4]["error"]["code"] == "unknown_tensor"
    assert res[5] == {"ok": {"n": 4}}


async def test_a_request_without_items_is_refused_whole() -> None:
    async def handle(item: dict[str, Any]) -> dict[str, Any]:
        raise AssertionError("never called")

    with pytest.raises(ProtocolError):
        await multi_results({}, handle)
