"""Issue 28 against a real replicated cluster (1 controller, 3 parameter servers, processes on
loopback, peer identity on as `adamps up` sets it): what a holder of the cluster token, or a
server, could do to the replicas, and malformed replication messages.

- the issue's attack: a PREPARE + COMMIT of a +1000 batch to a secondary, claiming to be the
  bucket's primary (its id, the current epoch, seq = committed + 1), with the cluster token only:
  403 naming the credential, on /rpc and on the data port; nothing applied;
- a server cannot impersonate another: its own pair key with the secondary does not make a
  message from the primary;
- a NaN batch signed as the primary itself (the test holds the peer token) is refused by the
  secondary's own checks, not applied, and the replicas agree afterwards;
- malformed repl_* messages on /rpc, signed as the primary: a 4xx with a JSON error, never a 500;
- a replayed replication message (a seq the copy holds, with a valid MAC) changes nothing.
"""

from __future__ import annotations

import dataclasses
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adamps.client.dataplane import ERROR, REQUEST, frame_header
from adamps.client.rpc import RpcError, SyncRpc, json_request, rpc_request
from adamps.security import peer_auth
from adamps.server.replication.peers import PeerStream, SegmentDigests
from adamps.server.replication.wire import updates_digest
from adamps.up.cluster import LocalCluster
from adamps.wire import protocol

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from frames import read_frame  # noqa: E402
from replicated_cluster import (  # noqa: E402  (in tests/; the tests import in importlib mode)
    SHARD,
    TOKEN,
    digests_agree,
    make_client,
    running_cluster,
    signed,
    signed_frame,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, Any, Any]]:
    root = tmp_path_factory.mktemp("hostile-repl")
    with running_cluster(root, n_servers=3, n_controllers=1) as c:
        client, layout = make_client(c)
        client.push_dense("x", np.ones(16_000, np.float32))
        try:
            yield c, client, layout
        finally:
            client.close()


def _target(c: LocalCluster, layout: Any) -> dict[str, Any]:
    """Bucket 0's members, addresses, one of its shards and the secondary's position (once
    every copy has every batch)."""
    digests_agree(c)
    view = c.cluster()
    assert view is not None
    b = next(x for x in view["buckets"] if x["bucket"] == 0 and x["secondaries"])
    servers = view["servers"]
    sid = next(s for s, bucket in layout.bucket_of.items() if bucket == 0)
    sec = b["secondaries"][0]
    with SyncRpc(servers[sec]["address"], TOKEN) as rpc:
        pos = rpc.call("digest", bucket=0)
        status = rpc.get_json("/status")
    return {
        "primary": b["primary"],
        "secondary_id": sec,
        "other": next(s for s in servers if s not in (b["primary"], sec)),
        "secondary": servers[sec]["address"],
        "data_port": int(status["data_port"]),
        "sid": sid,
        "epoch": pos["epoch"],
        "committed": pos["committed"],
        "digest": pos["digest"],
    }


def _forged_prepare(t: dict[str, Any], delta: np.ndarray, **more: Any) -> dict[str, Any]:
    """A PREPARE of the next batch of bucket 0 with one dense update (`more`: added to it)."""
    seq = t["committed"] + 1
    updates = [[{"k": "d", "s": t["sid"], "d": delta, **more}]]
    # a well-formed batch, its digest included: what refuses it is who sent it
    batch = {
        "seq": seq,
        "epoch": t["epoch"],
        "updates": updates,
        "clients": [None],
        "x": updates_digest(updates),
    }
    return {"bucket": 0, "sender": t["primary"], "epoch": t["epoch"], "entries": [batch]}


def _digest(t: dict[str, Any]) -> tuple[int, str]:
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        after = rpc.call("digest", bucket=0)
    return after["committed"], after["digest"]


def test_a_cluster_token_holder_cannot_send_replication_ops(cluster) -> None:
    c, client, layout = cluster
    t = _target(c, layout)
    plus = np.full(SHARD, 1000.0, np.float32)
    seq = t["committed"] + 1
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        for op, fields in [
            ("repl_prepare", {**_forged_prepare(t, plus), "commit": seq}),
            ("repl_commit", {"bucket": 0, "sender": t["primary"], "epoch": t["epoch"], "seq": seq}),
            ("repl_ping", {"sender": t["primary"], "buckets": {"0": t["epoch"]}}),
            ("repl_multi", {"items": [{"op": "repl_prepare", **_forged_prepare(t, plus)}]}),
            ("repl_snapshot", {"bucket": 0, "joiner": t["secondary_id"]}),
        ]:
            with pytest.raises(RpcError) as err:
                rpc.call(op, **fields)
            assert err.value.http_status == 403 and err.value.code == "forbidden", (op, err.value)
            assert "cluster token is a client credential" in err.value.message
    # the data port: the same message as a repl_multi frame, with the cluster token
    req = protocol.request("repl_multi", token=TOKEN,
                           items=[{"op": "repl_prepare", **_forged_prepare(t, plus)}])  # fmt: skip
    meta, parts, n = protocol.encode_oob(req)
    with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
        s.sendall(frame_header(REQUEST, len(meta), n) + meta + b"".join(bytes(p) for p in parts))
        kind, reply = read_frame(s)
    assert kind == ERROR and reply["error"]["code"] == "forbidden", reply
    assert _digest(t) == (t["committed"], t["digest"])


def test_a_server_cannot_impersonate_another(cluster) -> None:
    c, client, layout = cluster
    t = _target(c, layout)
    plus = np.full(SHARD, 1000.0, np.float32)
    other, sec, primary = t["other"], t["secondary_id"], t["primary"]
    forged = _forged_prepare(t, plus)  # sender: the primary
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        # the other server signs with its own pair key, as itself, a message naming the primary
        with pytest.raises(RpcError) as err:
            signed(rpc, c, other, sec, "repl_prepare", **forged)
        assert err.value.http_status == 403 and "may not send as" in err.value.message
        # ... or claims the primary's id in the header, with its own key: the MAC fails
        req = rpc_request("repl_prepare", **forged)
        assert req.body is not None
        own = peer_auth.pair_key(c.peer_token, other, sec)
        bad = ((peer_auth.PEER_HEADER, f"{primary} {peer_auth.mac(own, [req.body]).hex()}"),)
        with pytest.raises(RpcError) as err:
            rpc.send(dataclasses.replace(req, extra_headers=bad))
        assert err.value.http_status == 403 and "does not prove" in err.value.message
        # ... and as itself it is not the bucket's primary at this epoch: refused by the copy
        with pytest.raises(RpcError) as err:
            signed(rpc, c, other, sec, "repl_prepare", **{**forged, "sender": other})
        assert err.value.http_status == 409, err.value
    # and the controllers give a server's pair keys only to that server
    with SyncRpc(c.controllers[0], TOKEN) as ctl:
        with pytest.raises(RpcError) as err:
            ctl.post_json(
                f"/servers/{primary}/peer-keys", {"peers": [sec], "time": 0, "proof": "0"}
            )
        assert err.value.http_status == 403
    assert _digest(t) == (t["committed"], t["digest"])


def test_a_cluster_token_holder_cannot_make_a_servers_calls_to_the_controllers(cluster) -> None:
    """The controllers take register, heartbeat, role changes, caught-up, release and
    drop-secondary only with the named server's proof of its own key."""
    c, client, layout = cluster
    t = _target(c, layout)
    primary, sec, epoch = t["primary"], t["secondary_id"], t["epoch"]
    calls = [
        (f"/servers/{sec}/heartbeat", {}),
        (f"/servers/{sec}/register", {"address": "127.0.0.1:1"}),
        ("/buckets/0/drop-secondary", {"primary": primary, "epoch": epoch, "server": sec}),
        ("/buckets/0/role-change", {"server": sec, "prev_epoch": epoch}),
        ("/buckets/0/release", {"server": primary, "epoch": epoch}),
        ("/buckets/0/caught-up", {"primary": primary, "epoch": epoch, "server": sec}),
    ]
    with SyncRpc(c.controllers[0], TOKEN) as ctl:
        for path, body in calls:
            with pytest.raises(RpcError) as err:
                ctl.post_json(path, body)
            assert err.value.http_status == 403, (path, err.value)
            assert "cluster token is a client credential" in err.value.message
        # another server's own key does not make the primary's call either
        req = json_request("POST", "/buckets/0/drop-secondary", calls[2][1])
        assert req.body is not None
        own = peer_auth.server_key(c.peer_token, t["other"])
        hdr = peer_auth.server_call_header(
            own, t["other"], int(time.time()), "POST", req.path, req.body
        )
        with pytest.raises(RpcError) as err:
            ctl.send(dataclasses.replace(req, extra_headers=((peer_auth.SERVER_HEADER, hdr),)))
        assert err.value.http_status == 403
    view = c.cluster()
    b0 = next(x for x in view["buckets"] if x["bucket"] == 0)
    assert b0["primary"] == primary and sec in b0["secondaries"] and b0["epoch"] == epoch
    digests_agree(c)


def test_a_nan_batch_from_the_primary_itself_is_refused_by_the_secondary(cluster) -> None:
    c, client, layout = cluster
    t = _target(c, layout)
    nan = np.full(SHARD, np.nan, np.float32)
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        with pytest.raises(RpcError) as err:
            signed(rpc, c, t["primary"], t["secondary_id"], "repl_prepare",
                   **_forged_prepare(t, nan), commit=t["committed"] + 1)  # fmt: skip
        assert err.value.code == "non_finite", err.value
        try:  # a commit of that seq finds nothing prepared to apply
            signed(
                rpc, c, t["primary"], t["secondary_id"], "repl_commit", bucket=0,
                sender=t["primary"], epoch=t["epoch"], seq=t["committed"] + 1,
            )  # fmt: skip
        except RpcError as exc:
            assert 400 <= exc.status < 500, exc
        after = rpc.call("digest", bucket=0)
    assert (after["committed"], after["digest"]) == (t["committed"], t["digest"])
    client.push_dense("x", np.ones(16_000, np.float32))  # the real next batch still replicates
    values, _ = client.pull(["x"])
    assert np.isfinite(values["x"]).all()
    digests_agree(c)


def test_a_replayed_replication_message_changes_nothing(cluster) -> None:
    """A captured replication message, sent again later, with its MAC intact: here a PREPARE
    and a COMMIT of a seq the secondary already committed, signed as the primary (what an
    eavesdropper who recorded the primary's frames holds; the content is the test's own, +1000,
    so that applying it could not go unnoticed). On /rpc and as a repl_multi frame on the data
    port, twice each: the copy refuses or ignores every one (the replica state machine has that
    seq), its position and digest stay, and the replicas agree."""
    c, client, layout = cluster
    t = _target(c, layout)
    plus = np.full(SHARD, 1000.0, np.float32)
    old = {**t, "committed": t["committed"] - 1}  # _forged_prepare sends committed + 1
    prepare = {**_forged_prepare(old, plus), "commit": t["committed"]}
    commit = {"bucket": 0, "sender": t["primary"], "epoch": t["epoch"], "seq": t["committed"]}
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        for _ in range(2):
            for op, fields in (("repl_prepare", prepare), ("repl_commit", commit)):
                try:
                    signed(rpc, c, t["primary"], t["secondary_id"], op, **fields)
                except RpcError as exc:
                    assert 400 <= exc.http_status < 500, (op, exc)
    items = [{"op": "repl_prepare", **prepare}, {"op": "repl_commit", **commit}]
    meta, parts, n = protocol.encode_oob(
        protocol.request("repl_multi", token=TOKEN, peer=t["primary"], items=items)
    )
    payload = b"".join(bytes(p) for p in parts)
    key = peer_auth.pair_key(c.peer_token, t["primary"], t["secondary_id"])
    mac = peer_auth.mac(key, [meta, payload])
    frame = frame_header(REQUEST, len(meta), n + len(mac)) + meta + payload + mac
    with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
        for _ in range(2):  # the captured frame, byte for byte, twice
            s.sendall(frame)
            kind, reply = read_frame(s)
            if kind == ERROR:
                assert reply["error"]["code"] != "internal", reply
            else:
                for r in reply["results"]:
                    assert r.get("error", {}).get("code") != "internal", r
    assert _digest(t) == (t["committed"], t["digest"])
    client.push_dense("x", np.ones(16_000, np.float32))  # the real next batch still replicates
    digests_agree(c)


def test_a_segmented_frame_is_checked_on_the_data_port(cluster) -> None:
    """The data port's segmented frame MAC (issue 27), as a primary signs it (PeerStream.fits):
    the secondary advertises it, a replayed frame changes nothing, and one changed payload byte,
    or the MAC of another pair, is 403 forbidden before anything is used."""
    c, client, layout = cluster
    t = _target(c, layout)
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        assert rpc.get_json("/status")["peer_frame_mac"] == peer_auth.FRAME_MAC
    plus = np.full(SHARD, 1000.0, np.float32)
    old = {**t, "committed": t["committed"] - 1}  # a seq the copy holds: a replay
    items = [{"op": "repl_prepare", **_forged_prepare(old, plus), "commit": t["committed"]}]

    def frame(signer: str) -> bytearray:
        key = peer_auth.pair_key(c.peer_token, signer, t["secondary_id"])
        stream = PeerStream("127.0.0.1", t["data_port"], TOKEN, 5.0, SegmentDigests())
        meta, parts, n, _rid = stream.fits({"items": items}, t["primary"], key)  # type: ignore[misc]
        assert protocol.decode(meta)["mac"] == peer_auth.FRAME_MAC
        return bytearray(frame_header(REQUEST, len(meta), n) + meta + b"".join(map(bytes, parts)))

    good = frame(t["primary"])
    changed = bytearray(good)
    changed[-peer_auth.MAC_SIZE - 100] ^= 1  # a byte of the delta
    with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
        s.sendall(good)
        kind, reply = read_frame(s)
        assert kind != ERROR and all(
            r.get("error", {}).get("code") != "internal" for r in reply["results"]
        ), reply
    for bad in (changed, frame(t["other"])):
        with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
            s.sendall(bad)
            kind, reply = read_frame(s)
        assert kind == ERROR and reply["error"]["code"] == "forbidden", reply
    assert _digest(t) == (t["committed"], t["digest"])
    client.push_dense("x", np.ones(16_000, np.float32))  # the real next batch still replicates
    digests_agree(c)


def test_a_replication_message_naming_an_unknown_field_is_refused(cluster) -> None:
    """The replication ops are held to their fields like a client's ops (session 20): each
    message signed as the primary, past the peer check, with one field its op does not take,
    on /rpc and in a repl_multi (an item's, a batch's, an update's) on /rpc and the data port:
    400 bad_request naming it, nothing stepped into the copy."""
    c, client, layout = cluster
    t = _target(c, layout)
    plus = np.full(SHARD, 1000.0, np.float32)
    prepare = {**_forged_prepare(t, plus), "commit": t["committed"] + 1}
    commit = {"bucket": 0, "sender": t["primary"], "epoch": t["epoch"], "seq": t["committed"] + 1}
    bad_batch = {**prepare, "entries": [{**prepare["entries"][0], "client": ["c", 1]}]}
    ping = {"sender": t["primary"], "buckets": {"0": t["epoch"]}}
    cases = [
        ("repl_prepare", {**prepare, "comit": 1}, "'comit'"),
        ("repl_prepare", bad_batch, "'client'"),
        ("repl_commit", {**commit, "sq": 1}, "'sq'"),
        ("repl_ping", {**ping, "bucket": 0}, "'bucket'"),
        ("repl_multi", {"items": [], "itemz": []}, "'itemz'"),
        ("repl_snapshot", {"bucket": 0, "joiner": t["primary"], "joinn": 1}, "'joinn'"),
        ("digest", {"bucket": 0, "buckets": [1]}, "'buckets'"),
    ]
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        for op, fields, unknown in cases:
            with pytest.raises(RpcError) as err:
                signed(rpc, c, t["primary"], t["secondary_id"], op, **fields)
            assert err.value.code == "bad_request", (op, err.value)
            assert f"op {op!r}" in err.value.message and unknown in err.value.message, err.value
        items = [{"op": "repl_prepare", **prepare, "comit": 1}, {"op": "repl_commit", **commit}]
        reply = signed(rpc, c, t["primary"], t["secondary_id"], "repl_multi", items=items)
    first = reply["results"][0]["error"]
    assert first["code"] == "bad_request" and first["unknown"] == ["comit"], reply
    # the same repl_multi as a data-port frame (its batch's delta inline in the meta)
    with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
        s.sendall(signed_frame(c, t["primary"], t["secondary_id"], items))
        kind, reply = read_frame(s)
    assert kind != ERROR, reply
    first = reply["results"][0]["error"]
    assert first["code"] == "bad_request" and first["unknown"] == ["comit"], reply
    # an update inside a batch naming a field its kind does not take (the batch's digest valid):
    # refused by the kind's decoder, on /rpc and in a data-port frame alike
    odd = {**_forged_prepare(t, plus, dd=1), "commit": t["committed"] + 1}
    with SyncRpc(t["secondary"], TOKEN) as rpc:
        with pytest.raises(RpcError) as err:
            signed(rpc, c, t["primary"], t["secondary_id"], "repl_prepare", **odd)
    assert err.value.code == "bad_request", err.value
    assert "a 'd' update takes no field 'dd'" in err.value.message, err.value
    with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
        s.sendall(signed_frame(c, t["primary"], t["secondary_id"], [{"op": "repl_prepare", **odd}]))
        kind, reply = read_frame(s)
    assert kind != ERROR, reply
    first = reply["results"][0]["error"]
    assert first["code"] == "bad_request" and first["unknown"] == ["dd"], reply
    assert _digest(t) == (t["committed"], t["digest"])
    client.push_dense("x", np.ones(16_000, np.float32))  # the real next batch still replicates
    digests_agree(c)


def test_a_cut_or_oversized_peer_frame_is_dropped_and_changes_nothing(cluster) -> None:
    """The peer traffic of the data port (a repl_multi frame signed as the primary, with a +1000
    batch) cut inside its header, its meta, its payload and its MAC, then the connection
    closed; and frames whose header claims a meta or a payload past the limits: nothing
    applied, no internal error, no wait for bytes that never come, the port serving."""
    c, client, layout = cluster
    t = _target(c, layout)
    plus = np.full(SHARD, 1000.0, np.float32)
    items = [{"op": "repl_prepare", **_forged_prepare(t, plus), "commit": t["committed"] + 1}]
    frame = signed_frame(c, t["primary"], t["secondary_id"], items)
    header = 20
    for cut in (3, header - 1, header + 5, len(frame) // 2, len(frame) - 5):
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
            s.sendall(frame[:cut])
            s.shutdown(socket.SHUT_WR)
            try:
                kind, reply = read_frame(s)
                assert kind == ERROR and reply["error"]["code"] != "internal", (cut, reply)
            except ConnectionError:
                pass  # closed without an answer: the frame never came whole
        assert time.monotonic() - t0 < 5, cut
    for meta_len, payload_len in ((1 << 31, 0), (64, 1 << 62)):
        bad = frame_header(REQUEST, meta_len, payload_len)
        with socket.create_connection(("127.0.0.1", t["data_port"]), timeout=10) as s:
            s.sendall(bad + frame[header : header + 64])
            kind, reply = read_frame(s)
        assert kind == ERROR and reply["error"]["code"] == "too_large", reply
    assert _digest(t) == (t["committed"], t["digest"])
    client.push_dense("x", np.ones(16_000, np.float32))  # the real next batch still replicates
    digests_agree(c)


def _malformed() -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    junk = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), 2**63 - 1), st.text(max_size=8),
        st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(-5, 5), max_size=2),
        st.just(np.full(3, np.nan, np.float32)), st.just(np.zeros((2, 2), np.float64)),
    )  # fmt: skip
    update = st.one_of(
        junk,
        st.fixed_dictionaries(
            {"k": st.sampled_from(["d", "f", "c", "v", "z"])},
            optional={
                "s": junk,
                "d": junk,
                "t": junk,
                "a": junk,
                "e": junk,
                "w": junk,
                "r": junk,
                "n": junk,
                "b": junk,
                "o": junk,
                "y": junk,
                "x": junk,
            },
        ),  # fmt: skip
    )
    batch = st.one_of(
        junk,
        st.fixed_dictionaries(
            {
                "seq": st.one_of(st.integers(1, 5), junk),
                "epoch": st.one_of(st.integers(1, 5), junk),
            },
            optional={
                "updates": st.one_of(
                    junk, st.lists(st.one_of(junk, st.lists(update, max_size=2)), max_size=2)
                ),
                "clients": st.one_of(junk, st.lists(junk, max_size=2)),
            },
        ),  # fmt: skip
    )
    prepare = st.fixed_dictionaries(
        {"bucket": st.just(0), "sender": st.one_of(st.text(max_size=4), junk),
         "epoch": st.one_of(st.integers(1, 5), junk)},
        optional={"entries": st.one_of(junk, st.lists(batch, max_size=2)), "commit": junk},
    ).map(lambda m: ("repl_prepare", m))  # fmt: skip
    ping = st.fixed_dictionaries(
        {"sender": st.text(max_size=4), "buckets": st.dictionaries(st.text(max_size=4), junk, max_size=3)}
    ).map(lambda m: ("repl_ping", m))  # fmt: skip
    multi = st.lists(st.one_of(prepare, ping), max_size=2).map(
        lambda items: ("repl_multi", {"items": [{"op": op, **m} for op, m in items]})
    )
    return st.one_of(prepare, ping, multi)


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=_malformed())
def test_malformed_replication_messages_get_a_4xx_never_a_500(cluster, case) -> None:
    c, _client, layout = cluster
    op, fields = case
    view = c.cluster()
    assert view is not None
    b0 = next(x for x in view["buckets"] if x["bucket"] == 0)
    primary, sec = b0["primary"], b0["secondaries"][0]
    # sent as the primary (past the peer check, into the secondary's own checks)
    items = fields.get("items") if op == "repl_multi" else [fields]
    for item in items:
        if isinstance(item.get("sender"), str):
            item["sender"] = primary
    with SyncRpc(view["servers"][sec]["address"], TOKEN) as rpc:
        try:
            reply = signed(rpc, c, primary, sec, op, **fields)
        except RpcError as exc:
            assert 400 <= exc.status < 500, (op, fields, exc)
            return
    if op == "repl_multi":  # each item answered on its own, none an internal error
        for r in reply["results"]:
            assert r.get("error", {}).get("code") != "internal", (fields, r)
