"""Storage faults on one in-process parameter server with its real LMDB (issue 29): a standalone
server refuses to start on a record that fails its checksum; the scrub finds a damaged record
and the next flush rewrites it from memory; replication batches carry a checksum."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from adamps.config import ConfigError
from adamps.core.replication.bucket import Batch
from adamps.server.decode.dense import update as dense_update
from adamps.server.replication.wire import batch_from_wire, batch_to_wire
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError
from tests.integration.test_ps_app import start


def damage(ps, key: bytes) -> None:
    """Flips one byte near the end of shard record `key` in the server's own environment."""
    env = ps.persister.env
    with env.begin(write=True) as txn:
        db = env.open_db(b"shards", txn=txn)
        rec = bytearray(txn.get(key, db=db))
        rec[-3] ^= 0x10
        txn.put(key, bytes(rec), db=db)


async def filled(tmp_path: Path, **overrides):
    ps, runner, rpc = await start(tmp_path, **overrides)
    await rpc.call("create", name="w", shape=[3000], optimizer={"kind": "sgd", "lr": -1.0})
    await rpc.call("push_dense", tensor="w", delta=np.ones(3000, np.float32))
    await rpc.call("flush")
    return ps, runner, rpc


async def test_a_standalone_server_refuses_to_start_on_a_damaged_record(tmp_path: Path) -> None:
    ps, runner, rpc = await filled(tmp_path)
    damage(ps, b"w/1")
    await rpc.close()
    await runner.cleanup()
    with pytest.raises(ConfigError, match="fail their checksum.*w/1.*standalone"):
        await start(tmp_path)


async def test_the_scrub_finds_a_damaged_record_and_the_next_flush_rewrites_it(
    tmp_path: Path,
) -> None:
    ps, runner, rpc = await filled(tmp_path, scrub_rate=0)
    try:
        damage(ps, b"w/2")
        assert ps.persister.scan(None, 1 << 30)[0], "damaged on disk"
        passes = ps.scrubber.passes
        while ps.scrubber.passes == passes:
            ps.scrubber.step()
        assert ps.m.corrupt.labels("scrub")._value.get() == 1
        for _ in range(100):  # marked dirty on its owner thread
            if ps.store.dirty_count() == 1:
                break
            await asyncio.sleep(0.02)
        assert ps.store.dirty_count() == 1, "the shard is rewritten from memory"
        await rpc.call("flush")
        assert ps.persister.scan(None, 1 << 30)[0] == [], "rewritten"
        values = (await rpc.call("pull", tensors=["w"]))["tensors"]["w"]
        assert np.array_equal(values, np.ones(3000, np.float32))
    finally:
        await rpc.close()
        await runner.cleanup()


def test_a_replication_batch_damaged_on_the_wire_is_refused() -> None:
    batch = Batch(7, 2, ((dense_update("w/0", np.ones(4, np.float32)),),), (("c", 1),))
    wire = protocol.decode(protocol.encode(batch_to_wire(batch)))
    assert batch_from_wire(wire).seq == 7
    d = wire["updates"][0][0]["d"].copy()
    d[2] = np.nextafter(np.float32(1.0), np.float32(2.0))  # one bit flipped
    wire["updates"][0][0]["d"] = d
    with pytest.raises(ProtocolError, match="batch 7 of epoch 2 fails its checksum"):
        batch_from_wire(wire)
