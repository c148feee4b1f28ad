"""Issue 25's run endpoints against one in-process controller on loopback (real Raft, real HTTP):
create shows the token once and stores only its hash; bad input is a 400 naming the value, with
nothing proposed; a run's token may set its part of the layout and report its own progress, and
is refused (403, naming the run) on every operator endpoint; `adamps run` names a bad value."""

from __future__ import annotations

import json
import pickle
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from adamps import runs
from adamps.layout import Layout, TensorSpec
from controller import run_cmd
from tests.integration.test_controller_hardening import Ctl, start_controller


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[Ctl]:
    c, runner = await start_controller(tmp_path)
    try:
        yield c
    finally:
        await c.session.close()
        await runner.cleanup()


def layout(*tensors: tuple[str, tuple[int, ...]], n_buckets: int = 64) -> dict:
    return Layout([TensorSpec(n, s) for n, s in tensors], n_buckets).to_dict()


async def test_create_show_list_delete_and_the_token_is_only_a_hash(ctl: Ctl) -> None:
    status, body = await ctl.call(
        "POST", "/runs", {"name": "exp1", "quotas": {"param_elems": 100}, "consistency": "ssp:2"}
    )
    assert status == 200, body
    token = body["token"]
    assert body["run"]["namespace"] == "exp1.." and body["run"]["consistency"] == "ssp:2"
    # the Raft state (what a snapshot or a dump holds) has the hash, never the token
    state = ctl.read(lambda m: pickle.dumps(m))
    assert token.encode() not in state and runs.token_hash(token).encode() in state
    status, shown = await ctl.call("GET", "/runs/exp1")
    assert (
        status == 200 and token not in json.dumps(shown) and shown["quotas"] == {"param_elems": 100}
    )
    status, listed = await ctl.call("GET", "/runs")
    assert [r["name"] for r in listed["runs"]] == ["exp1"]
    status, again = await ctl.call("POST", "/runs", {"name": "exp1"})
    assert status == 409 and again["error"]["code"] == "exists"
    status, gone = await ctl.call("DELETE", "/runs/exp1")
    assert status == 200 and gone["deleted"] is True
    status, body = await ctl.call("GET", "/runs/exp1")
    assert status == 404


@pytest.mark.parametrize(
    "body, named",
    [
        ({"name": "a.b"}, "'a.b'"),
        ({"name": ""}, "run's name"),
        ({"name": "ok", "quotas": {"param_elems": -5}}, "param_elems"),
        ({"name": "ok", "quotas": {"rows": 5}}, "'rows'"),
        ({"name": "ok", "quotas": {"push_bytes_per_s": "fast"}}, "push_bytes_per_s"),
        ({"name": "ok", "consistency": "bsp"}, "'bsp'"),
    ],
)
async def test_bad_input_is_a_400_naming_it_and_nothing_is_proposed(
    ctl: Ctl, body: dict, named: str
) -> None:
    before = ctl.read(lambda m: m.applied)
    status, reply = await ctl.call("POST", "/runs", body)
    assert status == 400 and reply["error"]["code"] == "bad_request", reply
    assert named in reply["error"]["message"], reply
    assert ctl.read(lambda m: (m.applied, dict(m.runs_table()))) == (before, {})


async def test_a_runs_token_sets_its_layout_part_and_calls_no_admin_endpoint(ctl: Ctl) -> None:
    tokens = {}
    for name in ("a", "b"):
        status, body = await ctl.call("POST", "/runs", {"name": name})
        tokens[name] = body["token"]
    auth = {"Authorization": f"Bearer {tokens['a']}"}
    ok, body = await ctl.call("POST", "/layout", {"layout": layout(("a..w", (8, 4)))}, headers=auth)
    assert ok == 200, body
    auth_b = {"Authorization": f"Bearer {tokens['b']}"}
    ok, body = await ctl.call(
        "POST", "/layout", {"layout": layout(("b..w", (8, 4)))}, headers=auth_b
    )
    assert ok == 200, body
    _, got = await ctl.call("GET", "/layout")
    assert {t["name"] for t in got["layout"]["tensors"]} == {"a..w", "b..w"}
    status, body = await ctl.call(
        "POST", "/layout", {"layout": layout(("b..w", (8, 5)))}, headers=auth
    )
    assert status == 403 and body["error"]["namespace"] == "a..", body
    status, body = await ctl.call(
        "POST", "/progress", {"epoch": 1, "replica": "a/0", "progress": 1.0}, headers=auth
    )
    assert status == 200, body
    for method, path, payload in [
        ("POST", "/buckets/0/declare-lost", {}),
        ("POST", "/servers/ps0/drain", {}),
        ("POST", "/servers/ps0/undrain", {}),
        ("POST", "/rebalance", {}),
        ("POST", "/runs", {"name": "c"}),
        ("DELETE", "/runs/b", None),
        ("GET", "/auth/runs", None),
        ("POST", "/servers/ps0/register", {"address": "127.0.0.1:1"}),
        ("POST", "/servers/ps0/heartbeat", {}),
        ("POST", "/servers/ps0/peer-keys", {}),
        ("POST", "/buckets/0/role-change", {}),
        ("POST", "/buckets/0/release", {}),
    ]:
        # A valid run token outside its run's rights is 403 naming the run (issue 39 #14: some
        # of these answered 401 "wrong cluster token"); an unknown token is 401.
        status, body = await ctl.call(method, path, payload, headers=auth)
        assert status == 403 and body["error"]["code"] == "forbidden", (path, body)
        assert "'a'" in body["error"]["message"], body
        status, body = await ctl.call(method, path, payload, headers={"Authorization": "Bearer x"})
        assert status == 401 and body["error"]["code"] == "unauthorized", (path, body)
    status, body = await ctl.call("POST", "/rebalance", {}, headers={"Authorization": "Bearer x"})
    assert status == 401
    assert ctl.read(lambda m: sorted(m.runs_table())) == ["a", "b"]


def test_the_cli_names_a_bad_value_before_calling_anyone(capsys: pytest.CaptureFixture) -> None:
    for argv, named in [
        (["create", "a.b"], "'a.b'"),
        (["create", "ok", "--param-elems", "0"], "param_elems"),
        (["create", "ok", "--consistency", "bsp"], "'bsp'"),
        (["show"], "a run's name is required: adamps run show NAME"),  # (was: "got None")
        (["create"], "a run's name is required: adamps run create NAME"),
    ]:
        assert run_cmd.main([*argv, "--controllers", "127.0.0.1:9"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("adamps run") and named in err, err


async def test_a_trainer_declares_its_runs_recorded_mode_and_refuses_another(ctl: Ctl) -> None:
    """`adamps train --run NAME` without --consistency declares the mode of the run's record;
    a different --consistency is refused at start-up naming both; a run without a record (a
    name used without `adamps run create`) and a static cluster are async."""
    import asyncio

    from trainer.config import TrainConfig
    from trainer.runmode import ModeError, resolve

    status, body = await ctl.call("POST", "/runs", {"name": "exp1", "consistency": "ssp:2"})
    assert status == 200, body
    run_token = body["token"]

    def cfg(**kw: object) -> TrainConfig:
        return TrainConfig(controllers=[f"127.0.0.1:{ctl.http}"], token=run_token, **kw)

    got = await asyncio.to_thread(resolve, cfg(run="exp1"))
    assert got.consistency == "ssp:2" and got.elastic  # still elastic: no --replica given
    got = await asyncio.to_thread(resolve, cfg(run="exp1", consistency="ssp:2"))
    assert got.consistency == "ssp:2"
    with pytest.raises(ModeError, match=r"--consistency sync differs from run 'exp1'.*ssp:2"):
        await asyncio.to_thread(resolve, cfg(run="exp1", consistency="sync"))
    got = await asyncio.to_thread(resolve, cfg(run="norecord", replica=0))
    assert got.consistency == "async"
    static = TrainConfig(ps=["http://127.0.0.1:1"], run="exp1", replica=0, token=run_token)
    assert resolve(static).consistency == "async"  # no controllers: nobody to ask, no request


async def test_create_refuses_a_token_file_it_cannot_own_before_creating_the_run(
    ctl: Ctl, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The token is shown once: a --token-file that exists (another run's token may be in it)
    or cannot be created is refused before the run is created, so no run is left whose token
    nobody holds; otherwise the file gets the token, mode 0600. An error names its code once."""
    import asyncio

    from tests.integration.test_controller_hardening import TOKEN

    def cli(*args: str) -> int:
        return run_cmd.main([*args, "--controllers", f"127.0.0.1:{ctl.http}", "--token", TOKEN])

    other = tmp_path / "other.token"
    other.write_text("another run's token\n")
    for path, why in ((other, "exists"), (tmp_path / "no" / "dir" / "t", "cannot be created")):
        assert await asyncio.to_thread(cli, "create", "r1", "--token-file", str(path)) == 2
        err = capsys.readouterr().err
        assert why in err and str(path) in err, err
        status, _ = await ctl.call("GET", "/runs/r1")
        assert status == 404  # nothing created
    assert other.read_text() == "another run's token\n"
    fresh = tmp_path / "r1.token"
    assert await asyncio.to_thread(cli, "create", "r1", "--token-file", str(fresh)) == 0
    token = fresh.read_text().strip()
    assert token in capsys.readouterr().out and fresh.stat().st_mode & 0o777 == 0o600
    assert await asyncio.to_thread(cli, "create", "r1") == 1
    err = capsys.readouterr().err
    assert err.count("exists") == 2 and "exists: exists" not in err, err  # code, then message


async def test_the_operator_sets_one_runs_part_of_the_layout_and_keeps_the_others(
    ctl: Ctl,
) -> None:
    """`adamps train --run NAME` with the cluster token sends its layout with "run": only that
    run's part is replaced, also for a run name never created (an outside tester saw every
    other run's tensors erased from the layout); a run's token names only its own run."""
    status, body = await ctl.call("POST", "/runs", {"name": "exp1"})
    token = body["token"]
    mine = {"layout": layout(("exp1..w", (10,))), "run": "exp1"}
    status, body = await ctl.call(
        "POST", "/layout", mine, headers={"Authorization": f"Bearer {token}"}
    )
    assert status == 200, body
    status, body = await ctl.call(
        "POST", "/layout", {"layout": layout(("old..w", (5,))), "run": "old"}
    )
    assert status == 200, body  # the cluster token, a run never created
    status, body = await ctl.call(
        "POST", "/layout", {"layout": layout(("old..v", (7,))), "run": "old"}
    )
    assert status == 200, body
    status, got = await ctl.call("GET", "/layout")
    assert sorted(t["name"] for t in got["layout"]["tensors"]) == ["exp1..w", "old..v"]
    status, body = await ctl.call(
        "POST", "/layout", {"layout": layout(("old..x", (1,))), "run": "old"},
        headers={"Authorization": f"Bearer {token}"},
    )  # fmt: skip
    assert status == 403 and body["error"]["code"] == "forbidden", body
    status, body = await ctl.call("POST", "/layout", {"layout": layout(("a..w", (1,))), "run": 5})
    assert status == 400 and "run" in body["error"]["message"], body
