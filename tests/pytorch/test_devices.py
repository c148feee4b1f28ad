"""Parameters on any device and in bfloat16/float16 (issue 37, "Devices"): the copy path of
adamps/torch/staging.py, run on the CPU (a bfloat16 parameter takes the same buffered path as a
CUDA one), and on CUDA where there is one.

- the host buffers are allocated once and reused step after step (counted, and by identity);
- bfloat16 gradients reach the host as float32, the servers' float32 values reach a bfloat16
  parameter rounded;
- a model whose parameters are bfloat16 trains through a real `adamps ps` like the float32 one
  trained by plain torch.optim.SGD, within bfloat16's tolerance; a float32 one exactly;
- an adamps Embedding gives its rows in the module's dtype, on the ids' device.
"""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")
from torch import nn  # noqa: E402

import adamps.torch as at  # noqa: E402
from adamps.torch.params import Param, model_params  # noqa: E402
from adamps.torch.staging import HostStage, direct  # noqa: E402

CUDA = pytest.param(
    "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
)
DEVICES = ["cpu", CUDA]
STEPS, BATCH, LR = 40, 4, 0.1


def test_host_buffers_are_allocated_once_and_reused() -> None:
    stage = HostStage()
    g = torch.Generator().manual_seed(0)
    first = None
    for step in range(5):
        t = torch.randn(6, 5, generator=g).to(torch.bfloat16)
        host = stage.to_host("w", t)
        stage.wait()
        assert host.dtype == np.float32 and host.shape == (30,)
        assert np.array_equal(host, t.float().reshape(-1).numpy())  # bf16 -> float32 is exact
        if first is None:
            first = host
        assert host.ctypes.data == first.ctypes.data, step  # the same buffer every step
    assert stage.allocations == 1 and stage.syncs == 0  # (the CPU copies nothing in flight)
    # a smaller tensor under the key fits the buffer; a larger one grows it once
    stage.to_host("w", torch.ones(3, dtype=torch.bfloat16))
    assert stage.allocations == 1
    stage.to_host("w", torch.ones(40, dtype=torch.float16))
    assert stage.allocations == 2
    stage.to_host("w", torch.ones(50, dtype=torch.float16))  # within the doubled capacity
    assert stage.allocations == 2


def test_float32_on_the_cpu_is_not_copied() -> None:
    stage = HostStage()
    t = torch.randn(4, 3)
    assert direct(t)
    host = stage.to_host("w", t)
    assert np.shares_memory(host, t.numpy()) and stage.allocations == 0
    a = np.ones((2, 2), np.float32)  # (already on the host: as it is)
    assert np.shares_memory(stage.to_host("a", a), a)
    p = Param("w", "r..w", nn.Parameter(t))
    out = stage.value_buffers([p])
    assert np.shares_memory(out["r..w"], t.numpy())  # pulled straight into the parameter


def test_values_reach_a_bfloat16_parameter_rounded() -> None:
    stage = HostStage()
    p = Param("w", "r..w", nn.Parameter(torch.zeros(2, 3, dtype=torch.bfloat16)))
    bufs = []
    for k in range(3):
        out = stage.value_buffers([p])
        out["r..w"][:] = np.arange(6, dtype=np.float32).reshape(2, 3) / 3 + k
        bufs.append(out["r..w"].ctypes.data)
        stage.to_device([p])
        want = (torch.arange(6.0).reshape(2, 3) / 3 + k).to(torch.bfloat16)
        assert p.param.dtype == torch.bfloat16 and torch.equal(p.param.detach(), want)
    assert len(set(bufs)) == 1 and stage.allocations == 1
    # a module holding a stage copies and pickles without its buffers
    assert copy.deepcopy(stage).allocations == 0
    assert pickle.loads(pickle.dumps(stage)).allocations == 0


def test_which_dtypes_and_devices_a_model_may_have() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert len(model_params(nn.Linear(2, 2).to(dtype))) == 2
    with pytest.raises(at.ModelError, match=r"'weight' has dtype torch.float64.*model.float"):
        model_params(nn.Linear(2, 2).double())
    with pytest.raises(at.ModelError, match=r"'weight' is on the meta device"):
        model_params(nn.Linear(2, 2, device="meta"))
    at.Embedding(None, 4, table="t", dtype=torch.bfloat16)
    with pytest.raises(at.ModelError, match=r"float32, bfloat16 or float16, not torch.float64"):
        at.Embedding(None, 4, table="t", dtype=torch.float64)


def make_model(device: str, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # the 64 x 32 and 32 x 64 weights push act/err rows, the rest dense gradients (as in
    # test_equivalence.py): both forms go through the buffers
    return nn.Sequential(
        nn.Conv1d(1, 2, 3, padding=1), nn.Flatten(), nn.Linear(64, 32), nn.Tanh(),
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 3),
    ).to(device, dtype)  # fmt: skip


def batches(device: str, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(BATCH, 1, 32, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(STEPS)]  # fmt: skip
    return [(x.to(device, dtype), y.to(device)) for x, y in data]


def plain_sgd(
    device: str, start: torch.dtype, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """torch.optim.SGD in `dtype`, from the initial values in `start` (rounded to it)."""
    model = make_model(device, start).to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches(device, dtype):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(180)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_model_on_a_device_trains_like_plain_sgd(
    ps_url: str, token: str, device: str, dtype: torch.dtype
) -> None:
    want = plain_sgd(device, dtype)
    model = make_model(device, dtype)
    run = f"dev-{device}-{str(dtype).split('.')[1]}"
    opt = at.DownpourOptimizer(model, ps=[ps_url], lr=LR, optimizer="sgd", run=run, token=token)
    up, down = opt.worker.stage_up, opt.worker.stage_down
    allocated = None
    for step, (x, y) in enumerate(batches(device, dtype)):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y.to(device)).backward()
        opt.step()
        if step == 0:
            allocated = (up.allocations, down.allocations)
    # no host buffer was allocated after the first step; one synchronize per step on CUDA
    assert (up.allocations, down.allocations) == allocated
    buffered = dtype != torch.float32 or device != "cpu"
    assert (up.allocations > 0) == buffered and (down.allocations > 0) == buffered
    assert up.syncs == (STEPS if device == "cuda" else 0)
    assert opt.counts.forms["fc"] == 2 * STEPS and opt.counts.pushes == STEPS
    server = opt.model_state_dict()
    exact = {k: torch.from_numpy(v) for k, v in opt.conn.remote.values().items()}  # float32
    opt.close()
    init = {k: v.float() for k, v in make_model("cpu", dtype).state_dict().items()}
    for k, v in want.items():
        got, local = server[k], model.state_dict()[k]
        assert got.dtype == dtype and got.device.type == device, k
        assert local.dtype == dtype and local.device.type == device, k
        assert torch.equal(local, got), k  # the model holds the servers' values (rounded)
        if dtype == torch.float32:  # exactly plain SGD's (its own kernels on the device)
            assert torch.allclose(got.cpu(), v, atol=1e-4, rtol=0), (k, (got.cpu() - v).abs().max())
    # bfloat16: the same training within its rounding (8 bits of mantissa): the servers'
    # float32 values are at least as close to float32 SGD's as plain torch's own training in
    # bfloat16 is (the servers keep float32 values; only the gradients are bfloat16's)
    flat = lambda sd: torch.cat([sd[k].float().cpu().reshape(-1) for k in sorted(want)])  # noqa: E731
    moved = (flat(want) - flat(init)).norm()
    off = (flat(exact) - flat(want)).norm()
    assert moved > 0.1, moved  # it trained
    if dtype == torch.float32:
        assert off < 1e-5 * moved, (float(off), float(moved))
    else:
        bound = (flat(plain_sgd(device, dtype, dtype)) - flat(want)).norm()
        assert off < bound, (float(off), float(bound), float(moved))


@pytest.mark.slow  # a real `adamps ps` process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("device", DEVICES)
def test_an_embeddings_rows_come_in_its_dtype_on_the_ids_device(
    ps_url: str, token: str, device: str
) -> None:
    torch.manual_seed(3)
    model = nn.Sequential(
        at.EmbeddingBag(None, 8, mode="sum", table="bag", lr=0.1, dtype=torch.bfloat16),
        nn.Linear(8, 1),
    ).to(device, torch.bfloat16)  # fmt: skip
    opt = at.DownpourOptimizer(model, ps=[ps_url], lr=0.1, run=f"emb-{device}", token=token)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 50, (16, 3), generator=g).to(device)
    y = torch.randn(16, 1, generator=g).to(device, torch.bfloat16)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        out = model(ids)
        assert out.dtype == torch.bfloat16 and out.device.type == device
        loss = nn.functional.mse_loss(out.float(), y.float())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    opt.close()
    assert losses[-1] < 0.5 * losses[0], losses  # the rows and the head trained
