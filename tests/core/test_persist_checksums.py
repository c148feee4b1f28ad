"""Checksums on everything persisted (issue 29): a record whose bytes changed on disk is found by
``verify`` (at start), by ``scan`` (the scrub) and skipped by ``load``; a record without a
checksum is corrupt; an environment without this version's format stamp is refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import lmdb
import numpy as np
import pytest

from adamps.config import ConfigError
from adamps.layout import stable_bucket
from adamps.server.storage.persist import Persister, Position
from adamps.server.store import checksum

N_BUCKETS = 8


def fill(path: Path) -> Persister:
    p = Persister(path, map_size=1 << 22)
    meta = {"spec": {"name": "w", "shape": [4000]}, "optimizer": {"kind": "sgd"}, "seq": 0}
    shards = [(f"w/{i}", 3, np.ones(1000, np.float32), None) for i in range(4)]
    p.write_tensor(meta, shards)
    positions = {
        stable_bucket(f"w/{i}", N_BUCKETS): Position(1, 7, [["c", 1, 7]]) for i in range(4)
    }
    p.write_snapshots([], {b: pos for b, pos in positions.items()})
    return p


def flip_in_record(path: Path, db: bytes, key: bytes, offset: int = -4) -> None:
    env = lmdb.open(str(path), max_dbs=6)
    with env.begin(write=True) as txn:
        d = env.open_db(db, txn=txn)
        rec = bytearray(txn.get(key, db=d))
        rec[offset] ^= 1
        txn.put(key, bytes(rec), db=d)
    env.close()


def test_seal_and_unseal() -> None:
    rec = checksum.seal(b"abc", b"def")
    assert bytes(checksum.unseal(rec)) == b"abcdef"
    bad = bytearray(rec)
    bad[-1] ^= 1
    with pytest.raises(checksum.CorruptRecord, match="checksum mismatch"):
        checksum.unseal(bytes(bad))
    with pytest.raises(checksum.CorruptRecord, match="no checksum header"):
        checksum.unseal(b"[1, 2]")


def test_a_flipped_bit_in_a_shard_marks_its_bucket_and_only_it(tmp_path: Path) -> None:
    fill(tmp_path / "db").close()
    flip_in_record(tmp_path / "db", b"shards", b"w/2")
    p = Persister(tmp_path / "db", map_size=1 << 22)
    found = p.verify(N_BUCKETS)
    bad = stable_bucket("w/2", N_BUCKETS)
    assert set(found.buckets) == {bad} and found.everything is None
    assert "checksum mismatch" in found.buckets[bad]
    assert p.corrupt_records == {"load": 1}
    positions = p.load_positions(skip=found)
    assert bad not in positions and len(positions) >= 1
    (saved,) = p.load()
    assert "w/2" not in saved.shards and len(saved.shards) == 3, "never loaded"
    failures, last, _ = p.scan(None, budget=1 << 30)
    assert [(db, k) for db, k, _ in failures] == [("shards", b"w/2")] and last is None
    assert p.discard(found, N_BUCKETS) >= 2  # the shard record and the position of its bucket
    assert not p.verify(N_BUCKETS).buckets
    p.close()


def test_a_damaged_checksum_header_is_corrupt_not_legacy(tmp_path: Path) -> None:
    fill(tmp_path / "db").close()
    flip_in_record(tmp_path / "db", b"positions", b"%08d" % stable_bucket("w/0", N_BUCKETS), 0)
    p = Persister(tmp_path / "db", map_size=1 << 22)
    found = p.verify(N_BUCKETS)
    assert stable_bucket("w/0", N_BUCKETS) in found.buckets
    p.close()


def test_a_damaged_tensor_definition_distrusts_every_copy(tmp_path: Path) -> None:
    fill(tmp_path / "db").close()
    flip_in_record(tmp_path / "db", b"tensors", b"w", 20)
    p = Persister(tmp_path / "db", map_size=1 << 22)
    found = p.verify(N_BUCKETS)
    assert found.everything and all(found.bad(b) for b in range(N_BUCKETS))
    assert p.load_positions(skip=found) == {}
    p.close()


def test_an_environment_without_a_format_stamp_is_refused(tmp_path: Path) -> None:
    """Records without checksums and no format stamp (as an unreleased version wrote them): no
    migration guesses what they mean; the server refuses the directory, naming it."""
    env = lmdb.open(str(tmp_path / "db"), max_dbs=5, map_size=1 << 22)
    value = np.arange(10, dtype=np.float32)
    with env.begin(write=True) as txn:
        meta = {"spec": {"name": "w", "shape": [10]}, "optimizer": {"kind": "sgd"}, "seq": 0}
        txn.put(b"w", json.dumps(meta).encode(), db=env.open_db(b"tensors", txn=txn))
        rec = struct.pack("<QQQ", 5, 40, 0) + value.tobytes()
        txn.put(b"w/0", rec, db=env.open_db(b"shards", txn=txn))
    env.close()
    with pytest.raises(ConfigError, match=r"LMDB format none .* is not this version's b'3'"):
        Persister(tmp_path / "db", map_size=1 << 22)
    # an empty environment is new: stamped, and opened again as this version's
    (tmp_path / "new").mkdir()
    Persister(tmp_path / "new", map_size=1 << 22).close()
    Persister(tmp_path / "new", map_size=1 << 22).close()


def test_the_scrub_finds_a_damaged_record_at_a_bounded_rate(tmp_path: Path) -> None:
    from adamps.server.storage.scrub import Scrubber

    fill(tmp_path / "db").close()
    flip_in_record(tmp_path / "db", b"shards", b"w/1")
    p = Persister(tmp_path / "db", map_size=1 << 22)
    found: list[tuple[str, bytes]] = []
    read: list[int] = []
    s = Scrubber(
        p, rate=8192, on_failure=lambda db, k, e: found.append((db, k)), on_bytes=read.append
    )
    while s.passes == 0:
        n = s.step()
        assert n <= max(4096, 8192 * s.step_seconds) + 4100, "its budget and one record more"
    assert found == [("shards", b"w/1")]
    assert len(read) > 2, "a pass takes several steps at this rate"
    p.delete("shards", b"w/1")
    s.step()
    assert p.scan(None, 1 << 30)[0] == []
    p.close()


def test_the_scrubs_cpu_budget_sets_its_sleep() -> None:
    """Issue 36: the scrub uses at most its budget of one core, measured as its thread's CPU
    time: a step and the sleep after it last cpu / budget together."""
    from adamps.server.storage.scrub import budget_wait

    assert budget_wait(0.001, 0.001, 0.005) == pytest.approx(0.199), "1 ms of CPU: 200 ms in all"
    assert budget_wait(0.001, 0.5, 0.005) == 0.0, "a step that waited on the disk sleeps no more"
    assert budget_wait(0.0, 0.01, 0.005) == 0.0
    assert budget_wait(0.01, 0.01, 1.0) == 0.0, "a whole core: no sleep"
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="fraction of one core"):
            budget_wait(0.001, 0.001, bad)


def test_the_scrub_thread_keeps_within_its_cpu_budget(tmp_path: Path) -> None:
    """A scrub whose records cost much CPU (the real check, plus 2 ms of the thread's CPU per
    record): with a budget of 5% of a core, steps of one record, no byte bound to speak of and
    passes back to back, its thread uses about 5% of a core while it runs, and no more."""
    import time

    from adamps.server.storage.scrub import Scrubber

    fill(tmp_path / "db").close()
    p = Persister(tmp_path / "db", map_size=1 << 22)
    check = p.check_record

    def costly(db: str, key: bytes, value: bytes | memoryview) -> Exception | None:
        t = time.thread_time()
        while time.thread_time() - t < 0.002:
            pass
        return check(db, key, value)

    p.check_record = costly  # type: ignore[method-assign]
    s = Scrubber(p, rate=1 << 30, on_failure=lambda *a: None, step=1e-9, cpu=0.05, min_pass=0)
    s.start()
    t0 = time.monotonic()
    time.sleep(1.0)
    s.stop()
    elapsed = time.monotonic() - t0
    assert s._thread is not None and not s._thread.is_alive()
    assert s.cpu_used <= 0.05 * elapsed + 0.01, (s.cpu_used, elapsed)
    assert s.cpu_used >= 0.02 * elapsed, ("it scrubs at its budget", s.cpu_used, s.passes)
    p.close()


def test_status_shows_each_servers_last_flush_its_age_and_durability() -> None:
    from controller.status import render

    view = {
        "version": 3, "n_buckets": 8, "replication": 3, "under_replicated": 0, "unassigned": 0,
        "layout_version": 1, "servers": {
            "ps0": {"address": "a:1", "state": "live", "incarnation": 1},
            "ps1": {"address": "a:2", "state": "live", "incarnation": 1},
            "ps2": {"address": "a:3", "state": "dead", "incarnation": 1},
        }, "buckets": [],
    }  # fmt: skip
    servers = {
        "ps0": {"last_flush": {"time": 0.0 + 3600, "age_seconds": 0.4}, "durable": True},
        "ps1": {
            "last_flush": {"time": 7200.0, "age_seconds": 12.25},
            "durable": False,
            "not_durable": "disk full: /d has 0 bytes free",
        },
        "ps2": None,
    }
    text = render(view, [], {}, False, servers)
    assert "last flush (UTC)" in text and "flush age" in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("ps")}
    assert "01:00:00" in rows["ps0"] and "0.4s" in rows["ps0"] and "yes" in rows["ps0"]
    assert "02:00:00" in rows["ps1"] and "12.2s" in rows["ps1"] and "NO: disk full" in rows["ps1"]
    assert "unreachable" in rows["ps2"]


@pytest.mark.parametrize("stamp", [b"9", b"2"])
def test_an_environment_of_another_format_is_refused_with_a_clear_message(
    tmp_path: Path, stamp: bytes
) -> None:
    """A stamp of another format is refused, naming it, and the environment is left as it was.
    Issue 41: format 2 (rows in a record each) was never released, so it is not migrated
    either: no loader of an older format remains."""
    fill(tmp_path / "db").close()
    env = lmdb.open(str(tmp_path / "db"), max_dbs=8, lock=False)
    with env.begin(write=True) as txn:
        txn.put(b"format", stamp, db=env.open_db(b"meta", txn=txn))
    env.close()
    with pytest.raises(ConfigError, match=f"LMDB format {stamp!r} is not this version's b'3'"):
        Persister(tmp_path / "db", map_size=1 << 22)
    env = lmdb.open(str(tmp_path / "db"), max_dbs=8, lock=False, readonly=True)
    with env.begin() as txn:
        assert txn.get(b"format", db=env.open_db(b"meta", txn=txn)) == stamp
    env.close()


def test_a_create_written_off_the_loop_never_overwrites_a_definition_written_meanwhile(
    tmp_path: Path,
) -> None:
    """Issue 39: a create writes its definition and initial values on a worker thread
    (catalog.py). A peer's definition of the same tensor (state transfer, `ensure`) may be
    written in the meantime, and flushed values after it: the create's older initial state
    must then not replace them (`only_new`)."""
    p = Persister(tmp_path / "lmdb", 1 << 24, sync=False)
    try:
        meta = {"spec": {"name": "w", "shape": [4]}, "init": {"kind": "zeros"}, "seq": 0}
        newer = np.full(4, 7.0, np.float32)
        assert p.write_tensor({**meta, "seq": 1}, [("w/0", 5, newer, None)])
        zeros = np.zeros(4, np.float32)
        assert not p.write_tensor(meta, [("w/0", 0, zeros, None)], only_new=True)
        (saved,) = list(p.load())
        assert saved.meta["seq"] == 1
        version, value, _acc = saved.shards["w/0"]
        assert version == 5 and np.array_equal(np.asarray(value).reshape(-1), newer)
        assert p.write_tensor({**meta, "spec": {"name": "v", "shape": [4]}},
                              [("v/0", 0, zeros, None)], only_new=True)  # fmt: skip
    finally:
        p.close()
