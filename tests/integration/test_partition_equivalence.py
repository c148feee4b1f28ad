"""The partitioned model (trainer/partition.py) computes what the unpartitioned one does
(DistBelief 3, Adam 3.2): K = 2 and 3 real processes, exchanging through shared memory and
through loopback TCP, give the same logits, loss, gradients and act/err vectors as
trainer/model.py on the same weights and batches, and send exactly the boundary values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from adamps.up.procs import free_port
from trainer.model import Model
from trainer.partition import PARAM_KINDS, PartitionModel, part_name, split, units_of

PROBE = Path(__file__).with_name("partition_probe.py")
ROOT = Path(__file__).resolve().parents[2]

#: conv straight into conv (no pool between), 2 input channels, tanh and sigmoid
ODD: dict = {
    "name": "odd",
    "input": [10, 10, 2],
    "classes": 5,
    "layers": [
        {"type": "conv", "name": "c1", "size": 3, "filters": 5, "activation": "tanh"},
        {"type": "conv", "name": "c2", "size": 3, "filters": 4, "activation": "relu"},
        {"type": "pool", "name": "p", "size": 2},
        {"type": "fc", "name": "f", "units": 7, "activation": "sigmoid"},
        {"type": "softmax", "name": "out", "units": 5},
    ],
}


def _free_ports(n: int) -> list[int]:
    """n distinct ports, free a moment ago, below the ephemeral range (adamps.up.procs.free_port:
    an outgoing connection cannot take one before a partition listens on it)."""
    out: list[int] = []
    while len(out) < n:
        port = free_port()
        if port not in out:
            out.append(port)
    return out


def _reference(spec, seed, batches, scale):
    full = Model(spec)
    full.init_params(seed)
    rng = np.random.default_rng(seed)
    ref = []
    for batch in batches:
        x = full.prepare(rng.integers(0, 256, (batch, *full.input_shape), dtype=np.uint8))
        y = rng.integers(0, full.layers[-1].out_shape[0], batch)
        logits = full.forward(x).copy()
        loss = full.loss_and_grad(x, y, scale=scale)
        grads = {n: full.grad(n).copy() for n, _ in full.tensors()}
        vec = {n: (a.copy(), e.copy()) for n, (a, e) in full.fc_vectors().items()}
        ref.append((logits, loss, grads, vec))
    return full, ref


def _exchanged_bytes(spec, parts: int, batch: int) -> int:
    """Over all partitions, per forward + backward: every crossing value once per partition
    that needs it, each way, plus the forward-only logits all-gather (called twice: forward()
    and loss_and_grad())."""
    full = Model(spec)
    total = 0
    for i, layer in enumerate(full.layers):
        if layer.kind in PARAM_KINDS and i > 0:
            total += 2 * 2 * (parts - 1) * batch * int(np.prod(layer.in_shape)) * 4
            total -= (parts - 1) * batch * int(np.prod(layer.in_shape)) * 4  # 1 backward
    classes = full.layers[-1].out_shape[0]
    return total + 2 * (parts - 1) * batch * classes * 4


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("spec", ["adam-mnist", ODD], ids=["adam-mnist", "odd"])
def test_partitioned_equals_unpartitioned(tmp_path, spec, parts, transport):
    seed, batches, scale = 7, [8, 3, 8], -0.03
    addrs = [f"127.0.0.1:{p}" for p in _free_ports(parts)]
    procs, outs = [], []
    for k in range(parts):
        out = tmp_path / f"p{k}.npz"
        outs.append(out)
        args = {
            "k": k, "parts": parts, "addrs": addrs, "transport": transport, "model": spec,
            "seed": seed, "batches": batches, "scale": scale, "out": str(out),
            "capacity": 1 << 20,
        }  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(PROBE), json.dumps(args)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"},
            )
        )
    try:
        for p in procs:
            assert p.wait(90) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    full, ref = _reference(spec, seed, batches, scale)
    got = [np.load(o) for o in outs]
    tol = {"rtol": 1e-4, "atol": 1e-5}
    for step, (logits, loss, grads, vec) in enumerate(ref):
        for k in range(parts):
            g = got[k]
            np.testing.assert_allclose(g[f"{step}/logits"], logits, **tol)
            assert abs(float(g[f"{step}/loss"]) - loss) < 1e-5
            for layer in full.layers:
                if layer.kind not in PARAM_KINDS:
                    continue
                lo, hi = split(units_of(layer.spec), parts)[k]
                name = part_name(layer.name, k, parts)
                for suffix in ("w", "b"):
                    np.testing.assert_allclose(
                        g[f"{step}/grad/{name}.{suffix}"],
                        grads[f"{layer.name}.{suffix}"][lo:hi],
                        **tol,
                    )
                if layer.kind in ("fc", "softmax"):
                    a, e = vec[f"{layer.name}.w"]
                    np.testing.assert_allclose(g[f"{step}/a/{name}.w"], a, **tol)
                    np.testing.assert_allclose(g[f"{step}/e/{name}.w"], e[:, lo:hi], **tol)
    sent = sum(int(g["bytes_sent"]) for g in got)
    assert sent == sum(_exchanged_bytes(spec, parts, b) for b in batches)


def test_one_partition_is_the_model():
    """K = 1 needs no exchange and is the unpartitioned model, bit for bit."""
    full = Model("adam-mnist")
    full.init_params(3)
    one = PartitionModel("adam-mnist", 0, 1)
    for layer in full.layers:
        for suffix in ("w", "b") if layer.kind in PARAM_KINDS else ():
            one.param(f"{part_name(layer.name, 0, 1)}.{suffix}")[...] = full.param(
                f"{layer.name}.{suffix}"
            )
    rng = np.random.default_rng(0)
    x = full.prepare(rng.integers(0, 256, (5, 28, 28), dtype=np.uint8))
    y = rng.integers(0, 10, 5)
    assert full.loss_and_grad(x, y) == one.loss_and_grad(x, y)
    np.testing.assert_array_equal(full.grads, one.grads)


@pytest.mark.slow
@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_a_dead_peer_fails_the_exchange_at_once(transport):
    """A partition SIGKILLed after connecting: the other's next exchange raises (EOF) instead of
    waiting for it forever (what lets a replica fail cleanly, trainer/partitioned.py)."""
    addrs = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    procs = []
    for k in range(2):
        args = {"k": k, "parts": 2, "addrs": addrs, "transport": transport,
                "model": "adam-mnist", "seed": 0, "batches": [], "scale": 1.0, "out": "",
                "capacity": 1 << 20, "die": 1}  # fmt: skip
        procs.append(
            subprocess.Popen(
                [sys.executable, str(PROBE), json.dumps(args)],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1"},
            )
        )
    try:
        assert procs[1].wait(30) == -9
        assert procs[0].wait(30) == 3
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
