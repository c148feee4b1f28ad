"""adamps.core.replication.invariants: ``ReplCore.validate()`` passes on states built through the core's
inputs (rounds in flight and decided, a joining copy, a reloaded standby copy), and each rule
fires, naming its bucket, on a copy of such a state with one field broken by hand (the only way
to reach a state the inputs never make; the randomized simulation validates after every
input, tests/core/test_replication_sim.py)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from adamps.core.replication.invariants import InvariantViolation
from adamps.core.replication.node import ReplCore
from adamps.core.replication.values import Pending
from tests.core.test_repl_core import Cluster, core, role


def cluster() -> Cluster:
    """a (primary), b, c of bucket 0: two rounds decided and committed everywhere, a third in
    flight (its PREPAREs sent, not answered). Every state on the way is valid."""
    cl = Cluster()
    a = cl.cores["a"]
    for i, now in ((1, 0.1), (2, 0.2)):  # (each COMMIT alone, past its delay: COMMIT_GAPS)
        a.submit({0: f"u{i}"}, ("cl", i), {0: f"w{i}"}, now)
        cl.collect()
        cl.deliver(now)
        a.tick(now + 0.2)
        cl.collect()
        cl.deliver(now + 0.2)
        for c in cl.cores.values():
            c.validate()
    a.submit({0: "u3"}, ("cl", 3), {0: "w3"}, 0.5)
    cl.collect()
    for c in cl.cores.values():
        c.validate()
    return cl


def test_states_built_through_the_inputs_are_valid() -> None:
    cl = cluster()
    a, b = cl.cores["a"].buckets[0], cl.cores["b"].buckets[0]
    assert (a.committed, b.committed, a.inflight[0].seq) == (2, 2, 3)  # type: ignore[index]
    assert cl.cores["a"]._rounds[0].out  # the third round's messages are in flight
    cl.deliver(0.5)
    for c in cl.cores.values():
        c.validate()
    # A joining copy, a reloaded copy held as standby, a copy dropped when its role ends.
    d = core("d")
    d.on_roles({"version": 1, "roles": [role(0, 1, "a", ["b", "c"], ["d"])]}, 0.0, 0.0)
    d.reloaded(1, 5, 1, [], [])
    assert d.roles == {0: "joining", 1: "standby"}
    d.validate()
    d.on_roles({"version": 2, "roles": [role(1, 2, "d", ["a"])]}, 1.0, 1.0)
    assert set(d.buckets) == {1} and d.roles[1] == "primary"
    d.validate()


def _primary(cl: Cluster) -> ReplCore:
    return cl.cores["a"]


def _secondary(cl: Cluster) -> ReplCore:
    return cl.cores["b"]


def _log0(c: ReplCore) -> Any:
    return c.buckets[0].log[0]


# (which core, how its copy is broken, what the violation says)
BROKEN: list[tuple[Callable[[Cluster], ReplCore], Callable[[ReplCore], None], str]] = [
    (_secondary, lambda c: c.roles.pop(0), "bucket 0: a copy without a role"),
    (_secondary, lambda c: c.roles.update({4: "standby"}), "bucket 4: a role without a copy"),
    (_secondary, lambda c: c.roles.update({0: "leader"}), "unknown role 'leader'"),
    (_secondary, lambda c: c.roles.update({0: "primary"}), "role primary but"),
    (_secondary, lambda c: setattr(c.buckets[0], "bucket", 3), "holds the state of bucket 3"),
    (_secondary, lambda c: c.buckets[0].prepared.update({1: _log0(c)}), "prepared seq 1 <="),
    (_secondary, lambda c: c.buckets[0].prepared.update({5: _log0(c)}), "prepared[5] holds"),
    (_secondary, lambda c: setattr(c.buckets[0], "log_limit", 1), "> log_limit 1"),
    (
        _secondary,
        lambda c: c.buckets[0].log.__setitem__(0, dataclasses.replace(_log0(c), seq=-4)),
        "from seq -4 to 2",
    ),
    (_secondary, lambda c: setattr(c.buckets[0], "committed", 4), "not at the committed"),
    (_secondary, lambda c: setattr(c.buckets[0], "committed_epoch", 7), "not at the committed"),
    (_secondary, lambda c: c.persisted.update({0: 9}), "persisted cut 9 > committed 2"),
    (
        _secondary,
        lambda c: c.buckets[0].pending.append(Pending("u", None, "w")),
        "pending held, but b is not",
    ),
    (_secondary, lambda c: c.buckets[0].learners.update({"x": "syncing"}), "learners held"),
    (_secondary, lambda c: setattr(c.buckets[0], "needs_recovery", True), "needs recovery"),
    (
        _secondary,
        lambda c: setattr(c.buckets[0], "inflight", _primary_round(c)),
        "a round in flight, but",
    ),
    (
        _primary,
        lambda c: _set_round(c, seq=7),
        "round in flight of seq 7, committed 2",
    ),
    (_primary, lambda c: _set_round(c, epoch=0), "round in flight of epoch 0 under 1"),
    (_primary, lambda c: c.buckets[0].awaiting_commit.update({3: []}), "awaiting_commit of seq 3"),
    (_primary, lambda c: c.buckets[0].learners.update({"x": "asleep"}), "unknown state 'asleep'"),
    (_primary, lambda c: c.buckets[0].learner_joins.update({"x": 1}), "join ids of ['x']"),
    (_primary, lambda c: c.join_ids.update({7: 1}), "bucket 7: join_ids names a bucket not"),
    (_primary, lambda c: c._rids.clear(), "in flight but not in the message ids"),
    (_primary, lambda c: setattr(c, "_next_rid", 0), "above the last one given"),
]


def _primary_round(c: ReplCore) -> Any:
    return (dataclasses.replace(_log0(c), seq=c.buckets[0].committed + 1), [])


def _set_round(c: ReplCore, **change: Any) -> None:
    rep = c.buckets[0]
    batch, waiters = rep.inflight  # type: ignore[misc]
    rep.inflight = (dataclasses.replace(batch, **change), waiters)


@pytest.mark.parametrize("which, breaks, says", BROKEN, ids=[x[2] for x in BROKEN])
def test_each_rule_fires_on_a_broken_copy(
    which: Callable[[Cluster], ReplCore], breaks: Callable[[ReplCore], None], says: str
) -> None:
    cl = cluster()
    good = which(cl)
    bad = copy.deepcopy(good)
    breaks(bad)
    with pytest.raises(InvariantViolation, match="bucket") as err:
        bad.validate()
    assert says in str(err.value)
    assert str(err.value).startswith(f"{good.server_id}: ")
    good.validate()  # the copy was broken, not the original
