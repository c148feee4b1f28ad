"""One event of many inputs, one Ready carried out (adamps.server.replication.carry.Carrier.batch,
issue 36): a peer's frame of several buckets' PREPAREs, and a reply answering a primary's
messages to several buckets, enter the core input by input and their Ready is carried out once,
after the last, in the order the inputs made it. Real cores (tests/core/test_repl_core.py's);
the ports record what the shell is asked to do."""

from __future__ import annotations

from typing import Any

import pytest

from adamps.core.replication.values import Reject
from adamps.server.replication.carry import Carrier
from tests.core.test_repl_core import core, role, take

BUCKETS = (0, 1, 2)


class Ports:
    """The shell's ports, recording: drains (``counted``), applies, messages and pokes."""

    def __init__(self) -> None:
        self.t = 0.5
        self.drains = 0
        self.applied: list[tuple[int, Any]] = []
        self.sent: list[Any] = []
        self.pokes: list[float] = []

    def now(self) -> float:
        return self.t

    def counted(self, _rd: Any) -> None:
        self.drains += 1

    def apply_batches(self, b: int, batches: Any) -> None:
        self.applied += [(b, u) for batch in batches for u in batch.updates]

    def send(self, msg: Any, done: Any) -> None:
        self.sent.append((msg, done))

    def poke(self, not_before: float) -> None:
        self.pokes.append(not_before)

    def refuse(self, _b: int, rej: Reject) -> Reject:
        return rej

    def settle(self, _ans: Any) -> None: ...
    def release_copy(self, _b: int) -> None: ...
    def hold_copy(self, _b: int) -> None: ...
    def call(self, _req: Any) -> None: ...
    def ping(self, *_a: Any) -> None: ...
    def stop_join(self, _b: int) -> None: ...
    def start_join(self, _f: Any) -> None: ...


def cores() -> dict[str, Any]:
    """a primary of BUCKETS, b its secondary, each core's first messages delivered."""
    cs = {s: core(s, ping_interval=1000.0) for s in "ab"}
    roles = [role(b, 1, "a", ["b"]) for b in BUCKETS]
    for c in cs.values():
        c.on_roles({"version": 1, "roles": roles}, 0.0, 0.0)
        c.tick(0.0)
    cs["a"].on_roles({"renewed": [[b, 1] for b in BUCKETS]}, 0.0, 0.0)
    for m in take(cs["a"]).messages:  # the new primary's COMMITs (each member's position)
        reply = cs["b"].step("a", {"op": m.op, **m.fields}, 0.0)
        cs["a"].step("b", {"op": "reply", "rid": m.rid, "reply": reply}, 0.0)
    take(cs["a"]), take(cs["b"])
    return cs


def push(a: Any, k: int) -> list[Any]:
    """Push k to every bucket: the primary's messages it makes."""
    assert (
        a.submit({b: f"u{k}.{b}" for b in BUCKETS}, ("cl", k), {b: k for b in BUCKETS}, 0.1) is None
    )
    return take(a).messages


@pytest.mark.parametrize("batched", [False, True])
def test_a_frames_messages_step_one_by_one_and_their_ready_is_carried_out_once(
    batched: bool,
) -> None:
    cs = cores()
    a, ports = cs["a"], Ports()
    carrier = Carrier(cs["b"], ports, debug=True)
    for m in push(a, 1):  # the first round prepared on b (its replies back to a)
        reply = cs["b"].step("a", {"op": m.op, **m.fields}, 0.2)
        a.step("b", {"op": "reply", "rid": m.rid, "reply": reply}, 0.2)
    take(cs["b"])
    # what commits the first round on b (COMMITs, or the second round's PREPAREs carrying it)
    msgs = take(a).messages + push(a, 2)
    assert {m.fields["bucket"] for m in msgs} == set(BUCKETS)

    def feed() -> list[Any]:
        return [carrier.peer_message({"op": m.op, "sender": "a", **m.fields}) for m in msgs]

    if batched:
        with carrier.batch():
            replies = feed()
            assert ports.drains == 0 and ports.applied == [] and ports.pokes == []
    else:
        replies = feed()
    assert all(r["status"] == "ok" for r in replies), replies
    # the first round applied on b, in the inputs' order
    first = [m.fields["bucket"] for m in msgs if m.op == "repl_commit" or m.fields.get("commit")]
    assert ports.applied == [(b, f"u1.{b}") for b in dict.fromkeys(first)]
    assert sorted(b for b, _u in ports.applied) == list(BUCKETS)
    assert ports.drains == 1 if batched else ports.drains >= len(BUCKETS)
    assert len(ports.pokes) == (1 if batched else len(msgs))


def test_a_refusal_inside_a_batch_is_its_inputs_alone() -> None:
    cs = cores()
    ports = Ports()
    carrier = Carrier(cs["b"], ports, debug=True)
    msgs = push(cs["a"], 1)
    stale = {"op": "repl_prepare", "sender": "a", **msgs[1].fields, "epoch": 0}
    with carrier.batch():
        res = [carrier.peer_message({"op": m.op, "sender": "a", **m.fields}) for m in msgs[:1]]
        res.append(carrier.peer_message(stale))
        res.append(carrier.peer_message({"op": "repl_prepare", "sender": "a", **msgs[2].fields}))
    assert res[0]["status"] == "ok" and res[2]["status"] == "ok"
    assert isinstance(res[1], Reject) and res[1].code == "stale_epoch"
    assert ports.drains == 1


def test_a_replys_answers_are_one_event_on_the_primary() -> None:
    """The primary's answers to one peer's reply (several buckets' PREPAREs) enter the core
    one by one and their Ready (the next round's messages, the acknowledgements) once."""
    cs = cores()
    ports = Ports()
    carrier = Carrier(cs["a"], ports, debug=True)
    carrier.step(
        -1, cs["a"].submit, {b: f"u.{b}" for b in BUCKETS}, ("cl", 1), {b: b for b in BUCKETS}
    )
    assert ports.drains == 1 and len(ports.sent) == len(BUCKETS)
    replies = [(done, cs["b"].step("a", {"op": m.op, **m.fields}, 0.5)) for m, done in ports.sent]
    ports.sent.clear()
    with carrier.batch():
        for done, reply in replies:
            done(reply, None)
    assert ports.drains == 2
