"""Replica(model, loss_fn).fit(loader) with several Hogwild worker threads on one model, and
Strom's compression (issue 22), against a real `adamps ps`: the workers share the model (every
worker's pushes reach the servers: more steps than one worker), the replica learns a task a
linear model cannot fake, and with --compress the pushes go compressed and the replica still
learns; its state_dict equals the servers' values."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
pytestmark = pytest.mark.slow  # a real `adamps ps` process
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client.ps import PSClient, StaticRouting  # noqa: E402


def task(n: int = 2048, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """XOR of two coordinates' signs among 16 noise dimensions: needs the hidden layer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = ((x[:, 0] > 0) ^ (x[:, 1] > 0)).long()
    return x, y


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 2))


def batches(x: torch.Tensor, y: torch.Tensor, b: int = 16) -> list:  # type: ignore[type-arg]
    return [(x[i : i + b], y[i : i + b]) for i in range(0, len(y), b)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("compress", [False, True], ids=["dense", "compressed"])
def test_hogwild_replica_learns(ps_url: str, token: str, compress: bool) -> None:
    x, y = task()
    tx, ty = task(512, seed=1)
    m = model()
    rep = at.Replica(m, nn.functional.cross_entropy, ps=[ps_url], token=token, lr=0.2,
                     optimizer="sgd", workers=2, n_push=2, n_fetch=2, asynchronous=True,
                     compress={"fraction": 0.1} if compress else False,
                     run="hog-c" if compress else "hog")  # fmt: skip
    results = rep.fit(batches(x, y), epochs=8)
    assert sum(r.steps for r in results) == 8 * len(batches(x, y))
    acc = rep.evaluate([(tx, ty)])
    assert acc >= 0.8, acc  # XOR: a linear model scores 0.5; measured 0.87-0.89
    forms = rep.counts.forms
    if compress:
        assert forms.get("compressed", 0) > 0, forms
    else:
        assert forms.get("compressed", 0) == 0 and forms["dense"] > 0, forms
    # both workers pushed: the servers saw every step's update (pushes from 2 workers)
    assert rep.counts.pushes >= 8 * len(batches(x, y)) // 2 - 2
    state = rep.state_dict()
    tensor = {p.name: p.tensor for p in rep.conn.params}  # "hog..{0}0.weight": one group
    names = [tensor[k] for k in state]
    assert names[0] == f"{'hog-c' if compress else 'hog'}..{{0}}0.weight"
    rep.close()  # everything was pushed at the end of fit: nothing changes on the servers
    layout = rep.conn.remote.layout
    client = PSClient(StaticRouting([ps_url], layout.n_buckets), layout, token)
    got, _ = client.pull(names)
    client.close()
    for k, n in zip(state, names, strict=True):
        assert np.array_equal(got[n].reshape(state[k].shape), state[k].numpy()), k
