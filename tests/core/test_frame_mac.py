"""The data port's segmented frame MAC (issue 27): a repl_multi frame signed as a primary signs it
(PeerStream.fits) is accepted by the receiving server's PeerKeys.frame, each array is hashed once
for all peers, and any change to the meta or to any payload byte is refused as forbidden. A frame
in any other form (the MAC of the bytes alone, of a version never released) is refused. The same
frames through a real server's data port: tests/system/test_hostile_replication.py."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import numpy as np
import pytest

from adamps.security import peer_auth
from adamps.server.replication.peer_keys import PeerKeys
from adamps.server.replication.peers import CACHE_FROM, PeerStream, SegmentDigests
from adamps.wire import protocol
from adamps.wire.protocol import ProtocolError

PEER_TOKEN = "p" * 64
TOKEN = "t" * 64


class Controllers:
    async def peer_keys(self, server: str, peers: list[str], when: int, proof: str) -> Any:
        return {"keys": {p: peer_auth.pair_key(PEER_TOKEN, server, p).hex() for p in peers}}


def keys_of(server: str) -> PeerKeys:
    own = peer_auth.server_key(PEER_TOKEN, server)
    return PeerKeys(server, own, Controllers, lambda s: s in {"ps0", "ps1", "ps2"})


def message(arrays: list[np.ndarray]) -> dict[str, Any]:
    """A repl_multi message whose prepare carries `arrays` (and a commit without any)."""
    updates = [[{"k": "d", "s": f"w/{i}", "d": a}] for i, a in enumerate(arrays)]
    batch = {"seq": 3, "epoch": 2, "updates": updates, "clients": [None] * len(arrays), "x": 0}
    prepare = {"op": "repl_prepare", "bucket": 1, "epoch": 2, "sender": "ps0", "entries": [batch]}
    commit = {"op": "repl_commit", "bucket": 1, "epoch": 2, "sender": "ps0", "seq": 2}
    return {"items": [prepare, commit]}


def frame_to(receiver: str, msg: dict[str, Any], digests: SegmentDigests):
    """(meta, parsed meta, payload with its MAC) of the frame ps0 sends `receiver`."""
    key = peer_auth.pair_key(PEER_TOKEN, "ps0", receiver)
    meta, parts, n, _rid = PeerStream("h", 1, TOKEN, 1.0, digests).fits(msg, "ps0", key)  # type: ignore[misc]
    payload = np.frombuffer(b"".join(bytes(p) for p in parts), np.uint8).copy()
    assert payload.size == n
    return meta, protocol.decode(meta), payload


def receive(receiver: str, meta: bytes, payload: np.ndarray) -> tuple[str | None, dict[str, Any]]:
    return asyncio.run(keys_of(receiver).frame(protocol.decode(meta), meta, payload))


# odd sizes: padding between the arrays; an empty array: a segment of no bytes
ARRAYS = [np.arange(5, dtype=np.float32), np.zeros(0, np.float32), np.ones(1000, np.float32)]


def test_a_primarys_frame_is_accepted_and_decoded() -> None:
    meta, parsed, payload = frame_to("ps1", message(ARRAYS), SegmentDigests())
    assert parsed.get("mac") == peer_auth.FRAME_MAC
    peer, msg = receive("ps1", meta, payload)
    assert peer == "ps0"
    got = [u[0]["d"] for u in msg["items"][0]["entries"][0]["updates"]]
    for a, b in zip(ARRAYS, got, strict=True):
        np.testing.assert_array_equal(a, b)


def test_each_array_is_hashed_once_for_every_peer() -> None:
    digests = SegmentDigests(cache_from=0)
    msg = message(ARRAYS)
    frames = [frame_to(r, msg, digests) for r in ("ps1", "ps2")]
    assert digests.computed == 2 and digests.reused == 2  # two arrays with bytes, two peers
    for receiver, (meta, _parsed, payload) in zip(("ps1", "ps2"), frames, strict=True):
        assert receive(receiver, meta, payload)[0] == "ps0"
    # another frame of the same arrays, with other items around them: the same digests
    frame_to("ps1", {"items": [message(ARRAYS)["items"][1], *msg["items"]]}, digests)
    assert digests.computed == 2 and digests.reused == 4
    # and a cached digest is of that array object only, never of another at the same address
    frame_to("ps1", message([a.copy() for a in ARRAYS]), digests)
    assert digests.computed == 4


def test_the_digest_cache_is_bounded() -> None:
    digests = SegmentDigests(size=4, cache_from=0)
    for _ in range(10):
        frame_to("ps1", message([np.ones(3, np.float32)]), digests)
    assert len(digests._cache) <= 4


def test_small_arrays_are_hashed_for_each_frame_not_cached() -> None:
    """Below cache_from a segment is hashed again for each peer's frame (the cache's
    bookkeeping cost more than the hashing: issue 36's click-through step at RF 3); a large one
    is still hashed once for every peer. Both kinds of frame verify."""
    big = np.ones(CACHE_FROM // 4, np.float32)
    digests = SegmentDigests()
    msg = message([*ARRAYS, big])
    frames = [frame_to(r, msg, digests) for r in ("ps1", "ps2")]
    assert digests.computed == 5 and digests.reused == 1  # 2 small twice, the large one once
    assert list(digests._cache) == [id(big)]
    for receiver, (meta, _parsed, payload) in zip(("ps1", "ps2"), frames, strict=True):
        assert receive(receiver, meta, payload)[0] == "ps0"


def _refused(receiver: str, meta: bytes, payload: np.ndarray, why: str) -> None:
    with pytest.raises(ProtocolError) as err:
        receive(receiver, meta, payload)
    assert err.value.code == "forbidden" and why in err.value.message, err.value.message


def test_any_changed_byte_is_refused() -> None:
    meta, parsed, payload = frame_to("ps1", message(ARRAYS), SegmentDigests())
    n = payload.size - peer_auth.MAC_SIZE
    # every byte of the payload: in the arrays, in the padding after the first one, in the MAC
    for i in [0, 19, 20, 23, 24, n - 1, n, payload.size - 1]:
        bad = payload.copy()
        bad[i] ^= 1
        _refused("ps1", meta, bad, "does not prove")
    _refused("ps2", meta, payload, "does not prove")  # the pair key of another receiver
    forged = msgpack.packb({**parsed, "peer": "ps2"})  # another sender's name on ps0's MAC
    _refused("ps1", forged, payload, "does not prove")
    _refused("ps1", meta, payload[: peer_auth.MAC_SIZE - 1], "MAC is missing")


def test_a_frame_cannot_change_form() -> None:
    meta, parsed, payload = frame_to("ps1", message(ARRAYS), SegmentDigests())
    plain = dict(parsed)
    del plain["mac"]  # a frame that names no MAC form
    _refused("ps1", msgpack.packb(plain), payload, "unknown frame MAC")
    _refused("ps1", msgpack.packb({**parsed, "mac": "md5"}), payload, "unknown frame MAC")


def test_a_frame_of_a_peer_older_than_this_protocol_is_refused() -> None:
    """No fallback for a peer of a version never released: a frame signed with the MAC of its
    bytes (no segmented form named), however valid that MAC, is forbidden, and nothing is
    decoded for it."""
    key = peer_auth.pair_key(PEER_TOKEN, "ps0", "ps1")
    req = protocol.request("repl_multi", token=TOKEN, peer="ps0", **message(ARRAYS))
    meta, parts, _n = protocol.encode_oob(req, [])
    tag = peer_auth.mac(key, [meta, *parts])
    payload = np.frombuffer(b"".join([*(bytes(p) for p in parts), tag]), np.uint8).copy()
    _refused("ps1", meta, payload, "unknown frame MAC")


def test_a_segmented_frame_that_cannot_be_decoded_is_forbidden() -> None:
    meta, parsed, payload = frame_to("ps1", message(ARRAYS), SegmentDigests())
    entry = parsed["items"][0]["entries"][0]
    entry["updates"][2][0]["d"]["at"] = 10**9  # outside the payload: its segments are unknown
    _refused("ps1", msgpack.packb(parsed), payload, "cannot be verified")


def test_segments_cover_every_byte_once() -> None:
    data = memoryview(bytes(range(40)))
    whole = peer_auth.segment_digests(data, [])
    assert whole == [peer_auth.segment_digest([data])]
    # cuts outside the payload, repeated or at its start change nothing
    assert peer_auth.segment_digests(data, [0, 40, 99, -3]) == whole
    cut = peer_auth.segment_digests(data, [24, 8, 8])
    assert cut == [peer_auth.segment_digest([data[a:b]]) for a, b in [(0, 8), (8, 24), (24, 40)]]
    assert peer_auth.segment_digests(memoryview(b""), [0]) == []
    # the MAC binds the cuts: the same bytes cut elsewhere MAC differently
    key = b"k" * 32
    assert peer_auth.frame_mac(key, b"m", cut) != peer_auth.frame_mac(key, b"m", whole)
    assert peer_auth.frame_mac(key, b"m", cut) != peer_auth.mac(key, [b"m", data])


def test_a_batch_is_digested_once_for_all_its_peers(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    from adamps.core.replication.values import Batch
    from adamps.server.replication import wire as repl_wire

    calls = []
    real = repl_wire.updates_digest
    monkeypatch.setattr(repl_wire, "updates_digest", lambda u: calls.append(1) or real(u))
    updates = (({"k": "d", "s": "w/0", "d": np.ones(3, np.float32)},),)
    b = Batch(1, 1, updates, (("c", 1),))
    first = repl_wire.batch_to_wire(b)
    assert repl_wire.batch_to_wire(b) is first and len(calls) == 1
    # an equal batch that is another object is digested on its own
    assert repl_wire.batch_to_wire(Batch(1, 1, updates, (("c", 1),))) == first
    assert len(calls) == 2
    # kept exactly as long as its batch lives: the others' wire forms went with them
    others = [Batch(seq, 1, updates, (None,)) for seq in range(2, 6)]
    for o in others:
        repl_wire.batch_to_wire(o)
    assert id(others[0]) in repl_wire._WIRE
    del others, o
    gc.collect()
    assert set(repl_wire._WIRE) == {id(b)}
    assert repl_wire.batch_from_wire(first) == b


def test_a_batch_is_not_digested_again_however_many_other_batches_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Issue 36: the flush cut persists a prepared batch of every bucket (64 and more) and the
    sends go on meanwhile; a bounded cache of the last 64 batches was thrashed, so every cut
    and send digested the batches again (a tenth of a server's event loop in an RF 3
    push_rows profile). A batch a secondary received and verified is not digested again when
    it persists or (as a new primary) resends it."""
    from adamps.core.replication.values import Batch
    from adamps.server.replication import wire as repl_wire

    calls = []
    real = repl_wire.updates_digest
    monkeypatch.setattr(repl_wire, "updates_digest", lambda u: calls.append(1) or real(u))
    held = [
        Batch(seq, 1, (({"k": "d", "s": f"w/{seq}", "d": np.ones(3, np.float32)},),), (None,))
        for seq in range(200)
    ]
    wires = [repl_wire.batch_to_wire(b) for b in held]
    for _cut in range(3):  # flush cuts and resends of every held batch
        assert [repl_wire.batch_to_wire(b) for b in held] == wires
    assert len(calls) == len(held)
    # the copy that receives it verifies the digest once, and reuses it
    got = [repl_wire.batch_from_wire(protocol.decode(protocol.encode(w))) for w in wires]
    assert len(calls) == 2 * len(held)
    assert [repl_wire.batch_to_wire(b)["x"] for b in got] == [w["x"] for w in wires]
    assert len(calls) == 2 * len(held)


def test_a_frame_of_many_small_arrays_is_one_write_and_large_arrays_go_as_they_are() -> None:
    """Issue 36: a replication frame of one push_rows (21 buckets' ids and grads) was written
    part by part, ~45 send calls, each doing the receiver's TCP work too on loopback."""
    from adamps.client.dataplane import JOIN_BELOW, frame_writes

    head = b"H" * 20
    small = [np.full(100, i, np.float32) for i in range(42)]
    parts = [memoryview(a).cast("B") for a in small]
    writes = frame_writes(head, parts)
    assert len(writes) == 1 and writes[0] == head + b"".join(bytes(p) for p in parts)
    big = memoryview(np.ones(JOIN_BELOW // 4, np.float32)).cast("B")
    writes = frame_writes(head, [parts[0], big, parts[1], parts[2]])
    assert len(writes) == 3 and writes[1] is big  # from the array's memory, not copied
    assert b"".join(bytes(w) for w in writes) == head + bytes(parts[0]) + bytes(big) + bytes(
        parts[1]
    ) + bytes(parts[2])
    assert frame_writes(head, []) == [head]
