"""A restore's install retried after its primary was killed is applied once (issue 38 item 7),
with real processes on loopback: the install reached the primary, which replicated and
applied it, and died before its reply came back; the restore retries on the promoted copy with
the same (client, seq), which the copy recognizes. Every shard and row shard then reports the
version the checkpoint holds (a second apply would report one more) and the values are the
checkpoint's, bit for bit."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from adamps.checkpoint.cluster import Cluster
from adamps.checkpoint.restore import restore
from adamps.checkpoint.save_restore import load as load_ckpt
from adamps.checkpoint.save_restore import save
from adamps.client import ControllerRouting, PSClient
from adamps.layout import Layout, TensorSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import (  # noqa: E402  (in tests/; the tests import in importlib mode)
    N_BUCKETS,
    SHARD,
    TOKEN,
    running_cluster,
)

pytestmark = pytest.mark.slow

W = TensorSpec("w", (8_000,))


def _versions(manifest: dict[str, Any]) -> dict[str, int]:
    return {sid: rec["version"] for part in ("shards", "row_shards")
            for sid, rec in manifest[part].items()}  # fmt: skip


@pytest.mark.timeout(240)
def test_an_install_retried_after_its_primary_is_killed_is_applied_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    rng = np.random.default_rng(2)
    with running_cluster(tmp_path / "a", n_servers=3) as a:
        layout = Layout([W], n_buckets=N_BUCKETS, max_shard_elems=SHARD)
        client = PSClient(ControllerRouting(a.controllers), layout, TOKEN, retry_for=20.0)
        client.create(W, init={"kind": "normal", "std": 0.1, "seed": 5},
                      optimizer={"kind": "adagrad", "lr": 0.1})  # fmt: skip
        client.create_table("emb", 4, optimizer={"kind": "adagrad", "lr": 0.05})
        for _ in range(5):
            client.push_dense("w", rng.standard_normal(W.shape).astype(np.float32))
            ids = rng.integers(0, 5_000, 100)
            client.push_rows("emb", ids, rng.standard_normal((100, 4)).astype(np.float32))
        client.close()
        cl = Cluster(a.controllers, TOKEN)
        saved = save(cl, ckpt)
        cl.close()
    want = _versions(saved)
    assert min(v for sid, v in want.items() if "#rows" not in sid) >= 5
    with running_cluster(tmp_path / "b", n_servers=3) as b:
        view = b.cluster()
        assert view is not None
        victim = view["buckets"][0]["primary"]
        addr = b.servers[b.server_ids.index(victim)]
        killed: list[int] = []
        real = Cluster.message

        def message(self: Cluster, rpc: Any, op: str, **fields: Any) -> Any:
            reply = real(self, rpc, op, **fields)  # applied on every copy, then acknowledged
            if op == "ckpt_install" and not killed and rpc.base_url.endswith(addr):
                b.kill(victim)
                killed.append(fields["bucket"])
                raise ConnectionError("the primary died before its reply came back")
            return reply

        monkeypatch.setattr(Cluster, "message", message)
        cl = Cluster(b.controllers, TOKEN, retry_for=60.0)
        try:
            restore(cl, ckpt)
        finally:
            cl.close()
        monkeypatch.undo()
        assert killed, "no install reached the victim"
        cl = Cluster(b.controllers, TOKEN, retry_for=60.0)
        again = save(cl, tmp_path / "again")
        cl.close()
    assert _versions(again) == want  # applied once: no shard one version ahead
    _m, values, rows = load_ckpt(ckpt)
    _m2, values2, rows2 = load_ckpt(tmp_path / "again")
    assert sorted(values) == sorted(values2) and sorted(rows) == sorted(rows2)
    for k in values:
        assert values2[k].tobytes() == values[k].tobytes(), k
    for k in rows:
        assert rows2[k].tobytes() == rows[k].tobytes(), k
