"""Run by test_partition_equivalence.py as one partition process: builds partition k of K of a
model with weights cut from the unpartitioned model (seeded), runs forward and backward on a
seeded batch, exchanging through the given transport, and saves what it computed."""

from __future__ import annotations

import json
import os
import signal
import sys

import numpy as np

from trainer.exchange import Exchange, connect_mesh
from trainer.model import Model
from trainer.partition import PartitionModel, slice_params


def main() -> None:
    args = json.loads(sys.argv[1])
    k, parts = args["k"], args["parts"]
    full = Model(args["model"])
    full.init_params(args["seed"])
    links = connect_mesh(k, args["addrs"], 0, args["transport"], "t", capacity=args["capacity"])
    if args.get("die") == k:
        os.kill(os.getpid(), signal.SIGKILL)  # as a machine failure would
    ex = Exchange(k, parts, links)
    model = PartitionModel(args["model"], k, parts, ex)
    for name, value in slice_params(full, k, parts).items():
        model.param(name)[...] = value
    out: dict[str, np.ndarray] = {}
    rng = np.random.default_rng(args["seed"])
    if args.get("die") is not None:
        x = model.prepare(np.zeros((8, *model.input_shape), np.uint8))
        try:
            model.loss_and_grad(x, np.zeros(8, np.int64))
        except ConnectionError:
            sys.exit(3)  # the peer's death was noticed
        sys.exit(0)
    for step, batch in enumerate(args["batches"]):
        x = model.prepare(rng.integers(0, 256, (batch, *model.input_shape), dtype=np.uint8))
        y = rng.integers(0, model.classes, batch)
        out[f"{step}/logits"] = model.forward(x).copy()
        out[f"{step}/loss"] = np.array(model.loss_and_grad(x, y, scale=args["scale"]))
        for name, _ in model.tensors():
            out[f"{step}/grad/{name}"] = model.grad(name).copy()
        for name, (a, e) in model.fc_vectors().items():
            out[f"{step}/a/{name}"] = a.copy()
            out[f"{step}/e/{name}"] = e.copy()
    out["bytes_sent"] = np.array(ex.bytes_sent)
    np.savez(args["out"], **out)
    ex.close()


if __name__ == "__main__":
    main()
