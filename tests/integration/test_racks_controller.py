"""Racks at one in-process controller on loopback (issue 26): a registration names its rack,
/cluster shows it and how many buckets have two copies in one rack, the metric says the same,
and a bad rack is a 400 naming the field, with nothing changed."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.test_controller_hardening import Ctl, assert_serving, start_controller


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[Ctl]:
    c, runner = await start_controller(tmp_path, n_buckets=60, min_servers=6)
    try:
        yield c
    finally:
        await c.session.close()
        await runner.cleanup()


async def test_racks_are_registered_shown_and_keep_copies_apart(ctl: Ctl) -> None:
    for i in range(6):
        body = {"address": f"127.0.0.1:{7100 + i}", "rack": f"row1.r{i % 3}"}
        status, res = await ctl.call("POST", f"/servers/ps-{i}/register", body)
        assert status == 200 and res["rack"] == f"row1.r{i % 3}", res
    status, view = await ctl.call("GET", "/cluster")
    assert status == 200
    assert view["servers"]["ps-4"]["rack"] == "row1.r1"
    assert view["racks"] == 3 and view["rack_shared"] == 0
    for bv in view["buckets"]:
        holders = [bv["primary"], *bv["secondaries"]]
        assert len({view["servers"][s]["rack"] for s in holders}) == 3, bv
    ctl.service.m.update(True, 1, 1, ctl.service.cluster)
    from prometheus_client import generate_latest

    text = generate_latest(ctl.service.registry).decode()
    assert "adamps_controller_rack_shared_buckets 0.0" in text


@pytest.mark.parametrize("rack", ["a b", "x" * 65, 7, ["r1"], "r\u00e9"])
async def test_a_bad_rack_is_refused_naming_the_field(ctl: Ctl, rack) -> None:
    status, body = await ctl.call(
        "POST", "/servers/ps-9/register", {"address": "127.0.0.1:7109", "rack": rack}
    )
    assert status == 400 and body["error"]["code"] == "bad_request", body
    assert "rack" in body["error"]["message"]
    assert ctl.read(lambda m: "ps-9" not in m.servers)
    await assert_serving(ctl)
