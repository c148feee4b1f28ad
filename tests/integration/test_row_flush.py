"""Incremental row flush (issue 23): a flush writes the rows pushed since the previous flush, not
their buckets' whole row blocks, so its bytes follow the k rows touched (O(k)), whatever the
table holds; expired rows are deleted from LMDB; and a restart reloads every row exactly. One
parameter server in-process on loopback with its real LMDB."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np

from adamps.server.store.tables.rowdelta import page_rows, row_bytes
from tests.integration.test_tables import INIT, start

SGD = {"kind": "sgd", "lr": 0.5}
DIM = 16


async def test_a_flush_writes_the_rows_touched_not_the_table(tmp_path: Path) -> None:
    ps, runner, c, _ = await start(tmp_path)
    try:
        await c.call("create_table", name="big", dim=DIM, init=INIT, optimizer=SGD)
        n = 40_000
        for s in range(0, n, 10_000):  # a table of n rows, every bucket full of them
            ids = np.arange(s, s + 10_000, dtype=np.int64) * 7 + 3
            await c.call("push_rows", table="big", ids=ids, grads=np.ones((10_000, DIM), "f4"))
        whole = await c.call("flush")
        assert whole["bytes"] >= n * DIM * 4  # the first flush writes every row
        sizes = {}
        for k in (10, 100, 1000):
            ids = np.arange(k, dtype=np.int64) * 7 + 3  # rows that exist, in every bucket
            await c.call("push_rows", table="big", ids=ids, grads=np.ones((k, DIM), "f4"))
            sizes[k] = (await c.call("flush"))["bytes"]
        # O(pages touched): a page of page_rows rows around each touched row, at most, plus a
        # small fixed part per bucket (header, position), never the 40,000 rows (2.9 MB) the
        # buckets hold (main before issue 23 rewrote the blocks: ~2.6 MB each time)
        per = page_rows(DIM, 0, False)
        page = per * row_bytes(DIM, 0, False) + 64
        for k, b in sizes.items():
            assert b <= min(k, -(-n // per) + 8) * page + 8 * 512, (k, b, sizes)
            assert b < whole["bytes"] / 4, (k, b, whole)
        assert sizes[1000] >= 1000 * DIM * 4
        want = (await c.call("pull_rows", table="big", ids=np.arange(n) * 7 + 3))["rows"]
        assert (await c.call("flush"))["bytes"] == 0  # nothing touched: nothing written
    finally:
        await c.close()
        await runner.cleanup()
    ps, runner, c, _ = await start(tmp_path)  # reloaded from the flushed rows
    try:
        got = (await c.call("pull_rows", table="big", ids=np.arange(n) * 7 + 3))["rows"]
        assert np.array_equal(got, want)
        listed = (await c.call("list_tables"))["tables"]
        assert listed[0]["rows_held"] == n
    finally:
        await c.close()
        await runner.cleanup()


async def test_expired_rows_are_deleted_from_lmdb(tmp_path: Path) -> None:
    """A row removed by expiry after it was flushed is gone after a restart too (its record is
    deleted by the flush that follows), and the rows pushed since are there."""
    ps, runner, c, _ = await start(tmp_path)
    try:
        await c.call("create_table", name="e", dim=2, init=INIT, optimizer=SGD,
                     admission={"expire_after": 0.4})  # fmt: skip
        await c.call("push_rows", table="e", ids=np.arange(20), grads=np.ones((20, 2), "f4"))
        await c.call("flush")
        await asyncio.sleep(0.6)
        later = np.arange(100, 400)
        await c.call("push_rows", table="e", ids=later, grads=np.ones((300, 2), "f4"))
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 300
        want = (await c.call("pull_rows", table="e", ids=later))["rows"]
        await c.call("flush")
    finally:
        await c.close()
        await runner.cleanup()
    ps, runner, c, _ = await start(tmp_path)
    try:
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 300
        assert np.array_equal((await c.call("pull_rows", table="e", ids=later))["rows"], want)
    finally:
        await c.close()
        await runner.cleanup()


async def test_a_damaged_row_record_found_by_the_scrub_is_rewritten(tmp_path: Path) -> None:
    """The scrub finds a row record whose bytes were damaged on disk: counted, and the next
    flush rewrites the row shard from memory, so a restart reloads every row exactly."""
    from adamps.server.store.tables.rowdelta import row_prefix

    ps, runner, c, _ = await start(tmp_path, scrub_rate=0)
    ids = np.arange(500, dtype=np.int64)
    try:
        await c.call("create_table", name="s", dim=4, init=INIT, optimizer=SGD)
        await c.call("push_rows", table="s", ids=ids, grads=np.ones((500, 4), "f4"))
        await c.call("flush")
        want = (await c.call("pull_rows", table="s", ids=ids))["rows"]
        p = ps.persister
        with p.env.begin() as txn:  # one row page of the table, its value flipped
            cur = txn.cursor(db=p._rowpages)
            assert cur.set_range(row_prefix("s#rows/0"))
            key, rec = bytes(cur.key()), bytearray(cur.value())
        rec[-1] ^= 0xFF
        p._write(lambda txn: txn.put(key, bytes(rec), db=p._rowpages))
        while ps.scrubber.step() and ps.scrubber.after is not None:
            pass
        assert p.corrupt_records.get("scrub") == 1
        await asyncio.sleep(0.2)  # the mark reaches the owner thread
        assert (await c.call("flush"))["bytes"] > 0
    finally:
        await c.close()
        await runner.cleanup()
    ps, runner, c, _ = await start(tmp_path, scrub_rate=0)
    try:
        assert np.array_equal((await c.call("pull_rows", table="s", ids=ids))["rows"], want)
    finally:
        await c.close()
        await runner.cleanup()


async def test_the_frequency_filter_counts_survive_a_restart(tmp_path: Path) -> None:
    """Sightings counted before a flush are still counted after a restart: an id seen twice,
    then once more after the restart, gets its row at the third push (admit_after = 3)."""
    ps, runner, c, _ = await start(tmp_path)
    ids = np.arange(50, dtype=np.int64)
    g = np.ones((50, 2), "f4")
    try:
        await c.call("create_table", name="f", dim=2, init=INIT, optimizer=SGD,
                     admission={"admit_after": 3, "filter_width": 1024})  # fmt: skip
        for _ in range(2):
            await c.call("push_rows", table="f", ids=ids, grads=g)
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 0
        await c.call("flush")
    finally:
        await c.close()
        await runner.cleanup()
    ps, runner, c, _ = await start(tmp_path)
    try:
        await c.call("push_rows", table="f", ids=ids, grads=g)
        assert (await c.call("list_tables"))["tables"][0]["rows_held"] == 50
    finally:
        await c.close()
        await runner.cleanup()
