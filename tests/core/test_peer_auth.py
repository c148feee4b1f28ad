"""adamps.security.peer_auth and the server's PeerKeys (issue 28): who can derive which key, and what a
receiver refuses. The real controllers and servers are in tests/system/test_hostile_replication.py."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from adamps.security import peer_auth
from adamps.server.replication.peer_keys import PeerKeys
from adamps.wire.protocol import ProtocolError

PEER_TOKEN = "p" * 64


def test_keys_are_per_server_and_per_pair() -> None:
    a, b, c = "ps0", "ps1", "ps2"
    assert peer_auth.pair_key(PEER_TOKEN, a, b) == peer_auth.pair_key(PEER_TOKEN, b, a)
    assert len({peer_auth.pair_key(PEER_TOKEN, *p) for p in [(a, b), (a, c), (b, c)]}) == 3
    assert peer_auth.server_key(PEER_TOKEN, a) != peer_auth.server_key(PEER_TOKEN, b)
    # no separator games: ("ps", "1ps2") and ("ps1", "ps2") are different pairs
    assert peer_auth.pair_key(PEER_TOKEN, "ps", "1ps2") != peer_auth.pair_key(
        PEER_TOKEN, "ps1", "ps2"
    )
    assert peer_auth.pair_key("other", a, b) != peer_auth.pair_key(PEER_TOKEN, a, b)


def test_a_proof_is_of_one_server_within_its_window() -> None:
    key = peer_auth.server_key(PEER_TOKEN, "ps0")
    p = peer_auth.proof(key, "ps0", 1000)
    assert peer_auth.proof_ok(PEER_TOKEN, "ps0", 1000, p, now=1100.0)
    assert not peer_auth.proof_ok(PEER_TOKEN, "ps1", 1000, p, now=1100.0)
    assert not peer_auth.proof_ok(PEER_TOKEN, "ps0", 1000, p, now=1000 + peer_auth.PROOF_WINDOW + 1)
    assert not peer_auth.proof_ok(PEER_TOKEN, "ps0", 1001, p, now=1100.0)
    assert not peer_auth.proof_ok(PEER_TOKEN, "ps0", 1000, "é" * 64, now=1100.0)


@pytest.mark.parametrize("value", ["", "ps0", "ps0 zz", "ps0 " + "ab" * 31, " " + "ab" * 32])
def test_malformed_headers_parse_to_none(value: str) -> None:
    assert peer_auth.parse_header(value) is None


class Controllers:
    """Answers peer_keys as the controllers do (derivation from the peer token), or fails."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.asked = 0

    async def peer_keys(self, server: str, peers: list[str], when: int, proof: str) -> Any:
        self.asked += 1
        if self.fail is not None:
            raise self.fail
        assert peer_auth.proof_ok(PEER_TOKEN, server, when, proof, now=float(when))
        return {"keys": {p: peer_auth.pair_key(PEER_TOKEN, server, p).hex() for p in peers}}


def keys_of(server: str, ctl: Controllers) -> PeerKeys:
    own = peer_auth.server_key(PEER_TOKEN, server)
    return PeerKeys(server, own, lambda: ctl, lambda s: s in {"ps0", "ps1", "ps2"})


def test_a_receiver_accepts_only_the_prover_and_asks_the_controllers_once() -> None:
    async def run() -> None:
        ctl = Controllers()
        me, sender = keys_of("ps1", ctl), keys_of("ps0", Controllers())
        body = b"a replication message"
        hdr = (await sender.sign("ps1", body))[0][1]
        claimed, mac = peer_auth.parse_header(hdr)  # type: ignore[misc]
        assert await me.prover("repl_prepare", [body], claimed, mac) == "ps0"
        assert await me.prover("repl_prepare", [body], claimed, mac) == "ps0"
        assert ctl.asked == 1
        me.check_senders("repl_multi", {"items": [{"sender": "ps0"}, {"sender": "ps0"}]}, "ps0")
        cases = [
            ([body + b"!"], "ps0", mac, "does not prove"),  # changed on the way
            ([body], "ps2", mac, "does not prove"),  # another server's id, ps0's MAC
            ([body], "stranger", mac, "not a server of this cluster"),
            ([body], None, mac, "no peer credential"),
        ]
        for parts, who, got, why in cases:
            with pytest.raises(ProtocolError) as err:
                await me.prover("repl_prepare", parts, who, got)
            assert err.value.code == "forbidden" and why in err.value.message
        for msg in ({"sender": "ps2"}, {"sender": None}, {"items": [{"sender": "ps0"}, {}]}):
            op = "repl_multi" if "items" in msg else "repl_commit"
            with pytest.raises(ProtocolError) as err:
                me.check_senders(op, msg, "ps0")
            assert err.value.code == "forbidden" and "may not send as" in err.value.message
        down = keys_of("ps2", Controllers(ConnectionError("refused")))
        with pytest.raises(ProtocolError) as err:
            await down.prover("repl_prepare", [body], "ps0", mac)
        assert err.value.code == "unavailable"

    asyncio.run(run())


def test_without_a_key_nothing_is_signed() -> None:
    keys = PeerKeys("ps0", None, lambda: None, lambda s: True)
    assert not keys.enabled
    assert asyncio.run(keys.sign("ps1", b"x")) == ()


def test_a_local_cluster_makes_a_peer_token_and_gives_trainers_none(tmp_path) -> None:
    from adamps.up.cluster import LocalCluster

    a = LocalCluster(tmp_path / "a", token="t" * 64, n_servers=2)
    b = LocalCluster(tmp_path / "b", token="t" * 64, n_servers=2)
    assert len(a.peer_token) == 64 and a.peer_token != b.peer_token
    assert a.server_key(1) == peer_auth.server_key(a.peer_token, "ps1").hex()
    # what every process of the cluster gets (trainers started with start_process included)
    assert not any("PEER" in k or "SERVER_KEY" in k for k in a.env)
    off = LocalCluster(tmp_path / "c", token="t" * 64, n_servers=1, peer_token="")
    assert off.server_key(0) == ""


def test_a_servers_call_to_the_controllers_is_bound_to_it_and_to_the_request() -> None:
    key = peer_auth.server_key(PEER_TOKEN, "ps0")
    body = b'{"known_version": 3}'
    hdr = peer_auth.server_call_header(key, "ps0", 1000, "POST", "/servers/ps0/heartbeat", body)
    ok = peer_auth.server_call_ok
    assert ok(PEER_TOKEN, hdr, "POST", "/servers/ps0/heartbeat", body, now=1010.0) == "ps0"
    assert ok(PEER_TOKEN, hdr, "POST", "/servers/ps1/heartbeat", body, now=1010.0) is None
    assert ok(PEER_TOKEN, hdr, "POST", "/servers/ps0/heartbeat", b"{}", now=1010.0) is None
    assert ok(PEER_TOKEN, hdr, "POST", "/servers/ps0/heartbeat", body, now=5000.0) is None
    assert ok("other", hdr, "POST", "/servers/ps0/heartbeat", body, now=1010.0) is None
    forged = hdr.replace("ps0", "ps1", 1)  # another server's id on ps0's MAC
    assert ok(PEER_TOKEN, forged, "POST", "/servers/ps0/heartbeat", body, now=1010.0) is None
    for bad in ("", "ps0", "ps0 x y", "ps0 1000 zz"):
        assert ok(PEER_TOKEN, bad, "POST", "/servers/ps0/heartbeat", body, now=1010.0) is None
