"""Placement groups of a torch model's small parameters (issue 36, tensor fusion): packed
deterministically into groups of at most one shard, so that a small model's step touches a few
buckets; a large layer keeps its plain name; the export shows the parameters' own names; a run
made before groups keeps its plain names; a hostile group name is refused by the servers."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client.rpc import RpcError, SyncRpc  # noqa: E402
from adamps.layout import MAX_SHARD_ELEMS, group_of, ungrouped  # noqa: E402
from adamps.torch.params import ModelError, model_params, split_name  # noqa: E402
from adamps.torch.state_dict import state_dict_of  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from replicated_cluster import TOKEN, running_cluster  # noqa: E402


def convnet() -> nn.Module:
    """examples/torch_mnist.py's network: 12 small tensors (80,298 elements)."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def test_a_small_model_packs_into_one_group_deterministically() -> None:
    torch.manual_seed(0)
    params = model_params(convnet(), "r", fuse=True)
    again = model_params(convnet(), "r", fuse=True)  # a restarted replica: the same names
    assert [p.tensor for p in params] == [p.tensor for p in again]
    assert {group_of(p.tensor) for p in params} == {"r..{0}"}
    assert params[0].tensor == "r..{0}0.weight"
    for p in params:
        assert split_name(p.tensor) == ("r", p.name) and ungrouped(p.tensor) == f"r..{p.name}"
    plain = model_params(convnet(), "r")  # fuse=False: the names as before groups
    assert [p.tensor for p in plain] == [f"r..{p.name}" for p in plain]


def test_a_large_layer_keeps_its_name_and_groups_stay_within_a_shard() -> None:
    model = nn.Sequential(
        nn.Linear(64, 1000),
        nn.Linear(1000, 600),
        nn.Linear(600, 300),
        nn.Linear(300, 200),
        nn.Linear(200, 300),
    )  # weights 64,000, 600,000 (over a shard), 180,000, 60,000, 60,000; biases small
    params = model_params(model, "r", fuse=True)
    by = {p.name: p.tensor for p in params}
    assert by["1.weight"] == "r..1.weight"  # several shards: placed as before
    groups: dict[str, int] = {}
    for p in params:
        g = group_of(p.tensor)
        if g is not None:
            groups[g] = groups.get(g, 0) + p.param.numel()
    assert groups and all(n <= MAX_SHARD_ELEMS for n in groups.values())
    # first fit: 3.weight finds no room in group 0 (245,900 elements), opens group 1
    assert by["3.weight"] == "r..{1}3.weight" and by["4.weight"] == "r..{1}4.weight"
    assert len(groups) == 2 and sum(group_of(t) is not None for t in by.values()) == 9


def test_export_shows_the_parameters_names() -> None:
    params = model_params(convnet(), "r", fuse=True)
    values = {p.tensor: np.zeros(p.shape or (1,), np.float32) for p in params}
    values[params[0].tensor + "/accum"] = np.zeros(1, np.float32)  # not a parameter: dropped
    sd = state_dict_of({k: v for k, v in values.items() if "/" not in k}, "r")
    assert sorted(sd) == sorted(p.name for p in params)
    convnet().load_state_dict(
        {**{k: torch.as_tensor(v) for k, v in sd.items()},
         **{k: v for k, v in convnet().state_dict().items() if k not in sd}}  # BatchNorm buffers
    )  # fmt: skip


def test_a_brace_in_a_parameters_name_is_refused() -> None:
    model = nn.Module()
    model.add_module("a{0}b", nn.Linear(2, 2))
    with pytest.raises(ModelError, match=r"a\{0\}b"):
        model_params(model, "r", fuse=True)


def _committed(servers: list[str]) -> dict[int, int]:
    """bucket -> committed sequence number at its primary (one per bucket round)."""
    out: dict[int, int] = {}
    for addr in servers:
        with urllib.request.urlopen(f"http://{addr}/status", timeout=10) as r:
            st = json.load(r)
        for b, copy in (st["replication"] or {}).get("buckets", {}).items():
            if copy["role"] == "primary":
                out[int(b)] = copy["committed"]
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_small_models_step_touches_one_bucket_and_trains(tmp_path: Path) -> None:
    with running_cluster(tmp_path, n_servers=3, n_buckets=32, shard=MAX_SHARD_ELEMS) as c:
        torch.manual_seed(0)
        model = convnet()
        opt = at.DownpourOptimizer(model, controllers=c.controllers, run="fuse", token=TOKEN,
                                   lr=0.05, staleness="off")  # fmt: skip
        names = [p.tensor for p in opt.conn.params]
        assert all(n.startswith("fuse..{0}") for n in names), names
        x = torch.randn(64, 1, 28, 28)
        y = (x[:, 0, :14].mean((1, 2)) > x[:, 0, 14:].mean((1, 2))).long()  # learnable

        def loss() -> float:
            with torch.no_grad():
                model.eval()
                out = nn.functional.cross_entropy(model(x), y).item()
                model.train()
            return out

        before_loss = loss()
        before = _committed(c.servers)
        steps = 30
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.flush()
        after = _committed(c.servers)
        touched = {b for b in after if after[b] > before.get(b, 0)}
        rounds = sum(after[b] - before.get(b, 0) for b in touched)
        # the 12 tensors of the step are one group, in one bucket: one bucket round a step
        # (the code before groups: 10 buckets of 32, 10 bucket rounds a step)
        assert len(touched) == 1, (touched, names)
        assert 1 <= rounds <= steps, rounds
        # the servers hold what the model holds, and it learned
        got, _ = opt.conn.remote.client.pull(names)
        for p in opt.conn.params:
            assert np.array_equal(got[p.tensor].reshape(-1), p.param.detach().numpy().reshape(-1))
        assert loss() < 0.7 * before_loss, (before_loss, loss())
        opt.close()


@pytest.mark.slow
def test_a_run_made_before_groups_keeps_its_plain_names(ps_url: str, token: str) -> None:
    torch.manual_seed(0)
    old = convnet()
    opt = at.DownpourOptimizer(old, ps=[ps_url], token=token, run="old", lr=0.1, fuse=False)
    x, y = torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))
    opt.zero_grad()
    nn.functional.cross_entropy(old(x), y).backward()
    opt.step()
    opt.flush()
    saved = opt.state_dict()
    opt.close()
    torch.manual_seed(1)  # other values: a resumed run takes the servers'
    new = convnet()
    opt2 = at.DownpourOptimizer(new, ps=[ps_url], token=token, run="old", lr=0.1)  # fuse by default
    assert [p.tensor for p in opt2.conn.params] == [f"old..{p.name}" for p in opt2.conn.params]
    assert opt2.conn.created == []
    for (_, a), (_, b) in zip(old.named_parameters(), new.named_parameters(), strict=True):
        assert torch.equal(a, b)
    opt2.load_state_dict(saved)
    opt2.close()
    # a new run on the same servers is grouped
    opt3 = at.DownpourOptimizer(convnet(), ps=[ps_url], token=token, run="new", lr=0.1)
    assert all(p.tensor.startswith("new..{0}") for p in opt3.conn.params)
    opt3.close()


@pytest.mark.slow
@pytest.mark.parametrize("name", ["r..{a.b}x", "r..{}x", "r..{g}", "r..{g}x{h}y", "r..{g"])
def test_a_hostile_group_name_is_refused_by_the_server(ps_url: str, token: str, name: str) -> None:
    with SyncRpc(ps_url, token, 10.0) as rpc:
        with pytest.raises(RpcError) as exc:
            rpc.call("create", name=name, shape=[4])
        assert exc.value.http_status == 400 and "placement group" in str(exc.value)
        rpc.call("create", name="r..{g}x", shape=[4])  # still serving; a good group name
        assert "r..{g}x" in {t["name"] for t in rpc.call("list")["tensors"]}
