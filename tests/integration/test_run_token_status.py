"""Issue 39, finding 14: a valid run token used outside its run's rights is 403 forbidden
(naming the run), an unknown token 401, on every endpoint of a parameter server. `POST /flush`
answered a run's token 401 "wrong cluster token" where the docs say 403.

One in-process parameter server on loopback (real HTTP), given the controllers' run table as
its heartbeat would (``Tenancy.learn``)."""

from __future__ import annotations

import aiohttp
import pytest

from adamps import runs
from tests.integration.test_ps_app import TOKEN, start


@pytest.mark.parametrize(
    ("token", "status", "code"),
    [
        ("RUN", 403, "forbidden"),
        ("adamps-run-a-unknown", 401, "unauthorized"),
        (TOKEN, 200, None),
    ],
)
async def test_flush_with_a_run_token_is_403_and_an_unknown_token_401(
    tmp_path, token: str, status: int, code: str | None
) -> None:
    ps, runner, client = await start(tmp_path)
    run_token = runs.new_token("a")
    table = {"runs_version": 1,
             "runs": {"a": {"token_hash": runs.token_hash(run_token), "quotas": {}, "version": 1}}}  # fmt: skip
    ps.tenancy.learn(table)
    given = run_token if token == "RUN" else token
    try:
        async with aiohttp.ClientSession() as s:
            async with s.post(
                f"{client.base_url}/flush", headers={"Authorization": f"Bearer {given}"}
            ) as resp:
                body = await resp.json()
                assert resp.status == status, body
                if code is not None:
                    assert body["error"]["code"] == code, body
                if token == "RUN":
                    assert "'a'" in body["error"]["message"], body
    finally:
        await client.close()
        await runner.cleanup()
