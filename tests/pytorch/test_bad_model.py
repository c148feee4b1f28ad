"""Bad models get an error that names the problem, and nothing is created on the servers
(issue 22): a parameter that is not floating point, two parameters under one name, a tensor of
the run already on the servers with another shape, something that is not a Module."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.client.rpc import SyncRpc  # noqa: E402
from adamps.torch.params import split_name, tensor_name  # noqa: E402


def server_tensors(url: str, token: str) -> dict[str, list[int]]:
    rpc = SyncRpc(url, token)
    try:
        return {t["name"]: t["shape"] for t in rpc.call("list")["tensors"]}
    finally:
        rpc.close()


class IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)
        self.steps = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(60)
def test_bad_models_create_nothing(ps_url: str, token: str) -> None:
    with pytest.raises(at.ModelError, match=r"parameter 'steps' has dtype torch.int64"):
        at.DownpourOptimizer(IntParam(), ps=[ps_url], token=token)
    with pytest.raises(at.ModelError, match=r"'fc.weight' has dtype torch.float64.*model.float"):
        at.DownpourOptimizer(
            nn.ModuleDict({"fc": nn.Linear(2, 2)}).double(), ps=[ps_url], token=token
        )
    m = nn.Linear(3, 3)
    with pytest.raises(at.ModelError, match=r"two parameters are named 'w'"):
        at.Connection(m, ps=[ps_url], token=token,
                      named_parameters=[("w", m.weight), ("w", m.bias)])  # fmt: skip
    with pytest.raises(at.ModelError, match=r"expected a torch.nn.Module, got function"):
        at.DownpourOptimizer(lambda x: x, ps=[ps_url], token=token)  # type: ignore[arg-type]
    assert server_tensors(ps_url, token) == {}

    # Run "a" holds a 3 x 3 layer; a model whose fc1 is 4 x 3 in run "a" is refused before
    # its other tensor (fc2) is created; the same model in run "b" trains beside it.
    first = nn.ModuleDict({"fc1": nn.Linear(3, 3)})
    at.DownpourOptimizer(first, ps=[ps_url], token=token, run="a").close()
    before = server_tensors(ps_url, token)
    assert set(before) == {"a..{0}fc1.weight", "a..{0}fc1.bias"}  # one placement group
    other = nn.ModuleDict({"fc1": nn.Linear(3, 4), "fc2": nn.Linear(4, 1)})
    with pytest.raises(at.ModelError, match=r"'a..\{0\}fc1.weight' \(parameter 'fc1.weight'\) is "
                       r"\[3, 3\] on the servers, \[4, 3\] in the model"):  # fmt: skip
        at.DownpourOptimizer(other, ps=[ps_url], token=token, run="a")
    assert server_tensors(ps_url, token) == before
    at.DownpourOptimizer(other, ps=[ps_url], token=token, run="b").close()
    assert set(server_tensors(ps_url, token)) == set(before) | {
        "b..{0}fc1.weight", "b..{0}fc1.bias", "b..{0}fc2.weight", "b..{0}fc2.bias"}  # fmt: skip


def test_tensor_names_split_back() -> None:
    for run in ("default", "a.", "a..b", "x-y_z"):
        for param in ("w", "fc1.weight", "layers.0.norm.bias"):
            assert split_name(tensor_name(run, param)) == (run, param)
    with pytest.raises(at.ModelError, match="run must be"):
        tensor_name("a/b", "w")
