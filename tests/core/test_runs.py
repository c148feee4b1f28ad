"""Runs (issue 25) as pure code: names and namespaces, quotas, the push-rate limiter, and the
controllers' replicated run operations (no Raft, no sockets)."""

from __future__ import annotations

import copy
import pickle

import pytest

from adamps import runs
from adamps.core.lease import LeaseTerms
from adamps.layout import Layout, TensorSpec
from controller.state import ClusterModel

TERMS = LeaseTerms(duration=5.0, skew=0.1, margin=0.5)


def model() -> ClusterModel:
    return ClusterModel(8, TERMS)


def layout_of(*tensors: tuple[str, tuple[int, ...]]) -> dict:
    return Layout([TensorSpec(n, s) for n, s in tensors], 8).to_dict()


def created(m: ClusterModel, name: str, **quotas: float) -> str:
    token = runs.new_token(name)
    fields = {"token_hash": runs.token_hash(token), "quotas": quotas, "consistency": "async"}
    assert m.write_tenancy("create", name, fields, 10.0)["ok"]
    return token


def test_names_and_namespaces() -> None:
    assert runs.check_name("exp-1_a") == "exp-1_a"
    for bad in ["", "a.b", "a b", "x" * 65, None, 3]:
        with pytest.raises(runs.RunError, match="run's name"):
            runs.check_name(bad)
    assert runs.run_of("a..fc1.w") == "a"
    assert runs.run_of("a..fc1.w/3") == "a"  # a shard id belongs to its tensor's run
    assert runs.run_of("fc1.w") is None  # the operator's
    assert runs.run_of("a.b..x") is None  # no run is named "a.b"
    who = runs.Principal("a")
    assert who.outside(["a..x", "a..y/0"]) is None
    assert who.outside(["a..x", "b..x"]) == "b..x"
    assert who.outside(["ab..x"]) == "ab..x"  # a prefix of another run's name is no namespace
    assert runs.Principal().outside(["b..x", "y"]) is None  # the operator names anything


def test_quotas_and_consistency_are_checked() -> None:
    assert runs.check_quotas({"param_elems": 10, "push_bytes_per_s": 1.5}) == {
        "param_elems": 10,
        "push_bytes_per_s": 1.5,
    }
    with pytest.raises(runs.RunError, match="unknown quota 'rows'"):
        runs.check_quotas({"rows": 1})
    with pytest.raises(runs.RunError, match="param_elems must be an integer"):
        runs.check_quotas({"param_elems": 1.5})
    with pytest.raises(runs.RunError, match="table_rows"):
        runs.check_quotas({"table_rows": -1})
    assert runs.check_consistency(None) == "async"
    assert runs.check_consistency("ssp:3") == "ssp:3"
    with pytest.raises(runs.RunError, match="consistency"):
        runs.check_consistency("bsp")


def test_push_rate_admits_a_second_of_bytes_then_asks_to_wait() -> None:
    r = runs.PushRate(1000.0)
    assert r.take(600, now=0.0) == 0.0
    assert r.take(600, now=0.0) == 0.0  # the balance may go below zero once
    wait = r.take(1, now=0.0)
    assert wait == pytest.approx(0.2)  # 200 bytes of debt at 1000 B/s
    assert r.take(1, now=0.1) == pytest.approx(0.1)
    assert r.take(1, now=0.2) == 0.0
    # over a long stretch, the admitted bytes stay within rate x time + one second's burst
    r, admitted = runs.PushRate(1000.0), 0
    for i in range(10_000):
        if r.take(100, now=i * 0.001) == 0.0:
            admitted += 100
    assert admitted <= 1000 * 10 + 1000 + 100


def test_create_show_and_delete_a_run() -> None:
    m = model()
    token = created(m, "a", param_elems=100)
    view = m.run_view("a")
    assert view is not None
    assert view["namespace"] == "a.." and view["quotas"] == {"param_elems": 100}
    assert "token_hash" not in view and token not in repr(view)
    again = m.write_tenancy("create", "a", {"token_hash": "x"}, 11.0)
    assert again["ok"] is False and again["error"] == "exists"
    auth = m.runs_auth()
    assert auth["runs"]["a"]["token_hash"] == runs.token_hash(token)
    v = auth["runs_version"]
    assert m.write_tenancy("delete", "a", {}, 12.0)["ok"]
    assert m.run_view("a") is None
    auth = m.runs_auth()
    assert auth["runs_version"] > v and ["a", auth["runs_version"]] in auth["deleted"]
    gone = m.write_tenancy("delete", "a", {}, 13.0)
    assert gone["ok"] is False and gone["error"] == "not_found"


def test_a_runs_layout_is_its_namespace_only_and_within_its_quota() -> None:
    m = model()
    created(m, "a", param_elems=1000)
    created(m, "b")
    assert m.write_tenancy("layout", "a", {"layout": layout_of(("a..w", (10, 50)))}, 20.0)["ok"]
    assert m.write_tenancy("layout", "b", {"layout": layout_of(("b..w", (10, 50)))}, 21.0)["ok"]
    # both runs' tensors are in the cluster's layout: b's did not overwrite a's
    assert {t["name"] for t in m.layout["tensors"]} == {"a..w", "b..w"}
    # a run replaces its own part only
    assert m.write_tenancy("layout", "a", {"layout": layout_of(("a..v", (4,)))}, 22.0)["ok"]
    assert {t["name"] for t in m.layout["tensors"]} == {"a..v", "b..w"}
    before = copy.deepcopy(m.layout)
    over = m.write_tenancy("layout", "a", {"layout": layout_of(("a..w", (10, 101)))}, 23.0)
    assert over["ok"] is False and over["error"] == "quota_exceeded"
    assert over["quota"] == "param_elems" and "param_elems" in over["message"]
    outside = m.write_tenancy("layout", "a", {"layout": layout_of(("b..x", (4,)))}, 24.0)
    assert outside["ok"] is False and outside["error"] == "forbidden"
    assert outside["namespace"] == "a.."
    assert m.layout == before  # refusals change nothing
    # deleting a run takes its tensors out of the layout
    v = m.layout_version
    res = m.write_tenancy("delete", "a", {}, 25.0)
    assert res["tensors"] == ["a..v"]
    assert {t["name"] for t in m.layout["tensors"]} == {"b..w"} and m.layout_version == v + 1


def test_a_model_pickled_before_runs_existed_still_works() -> None:
    m = model()
    del m.__dict__["runs"], m.__dict__["runs_version"]  # as an earlier release's dump
    m = pickle.loads(pickle.dumps(m))
    assert m.runs_auth()["runs"] == {}
    created(m, "a")
    assert m.run_view("a") is not None


def test_run_tokens_lookups_during_a_fetch_wait_for_it() -> None:
    """Two trainers' first streams arrive together: the second waits for the first's fetch
    instead of being refused while it is in flight (seen as a 401 on a data server)."""
    import asyncio

    from adamps.security.run_tokens import RunTokens

    ta, tb = runs.new_token("a"), runs.new_token("b")
    fetches = []

    async def fetch() -> dict:
        fetches.append(1)
        await asyncio.sleep(0.05)
        return {
            "runs": {
                "a": {"token_hash": runs.token_hash(ta)},
                "b": {"token_hash": runs.token_hash(tb)},
            }
        }

    async def main() -> list:
        rt = RunTokens(fetch)
        got = await asyncio.gather(rt.run_of(ta), rt.run_of(tb), rt.run_of("nobody's"))
        return [*got, await rt.run_of(ta)]

    assert asyncio.run(main()) == ["a", "b", None, "a"]
    assert len(fetches) == 1  # one fetch served them all (and a miss does not refetch at once)


def test_a_round_push_names_every_layer_and_shard_for_the_namespace_check() -> None:
    """push_fc of a whole round (issue 27) names tensors and shards in `layers` and `dense`:
    a run's token must not reach another run's shards through them."""
    from adamps.server.api.tenancy import _names

    msg = {
        "op": "push_fc",
        "layers": {"a..f1.w": {"a": 0, "e": 0}, "a..f2.w": {"shards": ["b..f2.w/0"]}},
        "dense_shards": ["c..conv.w/0"],
        "dense": 0,
    }
    assert set(_names(msg)) == {"a..f1.w", "a..f2.w", "b..f2.w/0", "c..conv.w/0"}
    assert runs.Principal("a").outside(_names(msg)) in ("b..f2.w/0", "c..conv.w/0")


def test_a_runs_size_quotas_count_its_definitions_across_servers() -> None:
    """Issue 39, finding 8: the controllers count what each tensor and table of a run holds
    per copy (asked by the server that creates it), so a run cannot hold its quota on each
    server. The same name at the same size again (the client creates on every server) is no
    new use; at another size it is refused."""
    m = model()
    created(m, "r", param_elems=1000, memory_bytes=20_000)
    a = runs.tensor_cost(1000, 0)
    assert a == {"param_elems": 1000, "memory_bytes": 4000}
    assert m.write_tenancy("usage", "r", {"name": "r..a", "cost": a}, 11.0)["recorded"]
    again = m.write_tenancy("usage", "r", {"name": "r..a", "cost": a}, 11.0)
    assert again["ok"] and not again["recorded"]
    over = m.write_tenancy("usage", "r", {"name": "r..b", "cost": a}, 12.0)
    assert not over["ok"] and over["error"] == "quota_exceeded" and over["quota"] == "param_elems"
    assert over["asked"] == 2000 and over["limit"] == 1000
    other = m.write_tenancy("usage", "r", {"name": "r..a", "cost": runs.tensor_cost(10, 0)}, 13)
    assert not other["ok"] and other["error"] == "exists"
    # A table: max_rows rows (values, accumulators, id and time) and a sketch per bucket.
    t = runs.table_cost(10, 4, 4, 64, 8)
    assert t == {"table_rows": 10, "memory_bytes": 10 * (32 + 16) + 8 * 16 * 64}
    assert m.write_tenancy("usage", "r", {"name": "r..t", "cost": t}, 14.0)["ok"]
    wide = runs.table_cost(10, 4, 4, 4096, 8)  # 512 KiB of sketches
    over = m.write_tenancy("usage", "r", {"name": "r..u", "cost": wide}, 15.0)
    assert not over["ok"] and over["quota"] == "memory_bytes"
    assert runs.table_cost(None, 4, 0, None, 8) is None  # no max_rows: unbounded
    # a 16-bit table's values take 2 bytes each (issue 38): its memory_bytes counts that
    half = runs.table_cost(10, 4, 4, 64, 8, value_bytes=2)
    assert half is not None and half["memory_bytes"] == t["memory_bytes"] - 10 * 4 * 2
    assert m.run_view("r")["usage"] == {
        "param_elems": 1000, "table_rows": 10, "memory_bytes": 4000 + t["memory_bytes"]
    }  # fmt: skip
    # Bad asks change nothing; another run's name is forbidden.
    for fields in ({"name": "s..x", "cost": a}, {"name": "r..x", "cost": {"elems": 1}},
                   {"name": "r..x", "cost": {"param_elems": -1}}, {"name": 3, "cost": a}):  # fmt: skip
        assert not m.write_tenancy("usage", "r", fields, 16.0)["ok"]
    assert m.run_view("r")["usage"]["param_elems"] == 1000
    # Deleting the run frees its use with it.
    m.write_tenancy("delete", "r", {}, 17.0)
    created(m, "r", param_elems=1000)
    assert m.write_tenancy("usage", "r", {"name": "r..b", "cost": a}, 18.0)["recorded"]


def test_the_progress_board_keeps_a_bounded_number_of_replicas_per_epoch() -> None:
    """Issue 39, finding 8: the board took any number of replicas per epoch (1,500 posted were
    255 KB of Raft state). A new replica past the per-run or per-epoch cap is refused (413
    too_large); the replicas already there still report, and other epochs are not affected."""
    from controller.cluster_rules import PROGRESS_REPLICAS, PROGRESS_REPLICAS_PER_RUN

    m = model()
    for i in range(PROGRESS_REPLICAS_PER_RUN):
        assert m.report_progress(0, f"a/{i}", 0.5, False, 1.0)["ok"]
    over = m.report_progress(0, f"a/{PROGRESS_REPLICAS_PER_RUN}", 0.5, False, 2.0)
    assert not over["ok"] and over["error"] == "too_large" and "a" in over["message"]
    assert f"a/{PROGRESS_REPLICAS_PER_RUN}" not in m.progress["0"]
    assert m.report_progress(0, "a/0", 1.0, True, 3.0)["ok"]  # a known replica still reports
    assert m.report_progress(1, f"a/{PROGRESS_REPLICAS_PER_RUN}", 0.1, False, 4.0)["ok"]
    runs_needed = PROGRESS_REPLICAS // PROGRESS_REPLICAS_PER_RUN
    for r in range(1, runs_needed):
        for i in range(PROGRESS_REPLICAS_PER_RUN):
            assert m.report_progress(0, f"r{r}/{i}", 0.5, False, 5.0)["ok"]
    full = m.report_progress(0, "late/0", 0.5, False, 6.0)
    assert not full["ok"] and full["error"] == "too_large"
    assert len(m.progress["0"]) == PROGRESS_REPLICAS
