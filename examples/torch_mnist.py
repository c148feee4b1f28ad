"""A PyTorch convnet on the built-in MNIST (4,000 training, 1,000 held-out images), trained by
adamps as Downpour replicas:

    adamps up --torch examples.torch_mnist:Net          # the whole cluster on loopback

or, against a cluster you started, with your own loop (see docs/training.md):

    python examples/torch_mnist.py --controllers 127.0.0.1:7101 --dataservers http://127.0.0.1:7300

Its two nn.Linear layers push activation and error vectors (512 x 128: k (m + n) < m n for
k < 102 rows per push); the convolutions and biases push dense gradients.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn


def Net() -> nn.Module:  # noqa: N802 - a factory named like the module it returns
    return nn.Sequential(
        nn.Conv2d(1, 16, 5), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),   # 28 -> 24 -> 12
        nn.Conv2d(16, 32, 5), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),  # 12 -> 8 -> 4
        nn.Flatten(), nn.Linear(32 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def main() -> None:
    import adamps.torch
    from adamps.torch.data import dataserver_batches, heldout
    from dataserver.client import DataClient

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--controllers", default="127.0.0.1:7101")
    p.add_argument("--dataservers", default="http://127.0.0.1:7300")
    p.add_argument("--token", default=None, help="cluster token (default: $ADAMPS_TOKEN)")
    p.add_argument("--epochs", type=int, default=3)
    a = p.parse_args()
    torch.manual_seed(0)
    model = Net()
    opt = adamps.torch.DownpourOptimizer(
        model, controllers=a.controllers.split(","), lr=0.05, optimizer="sgd", n_push=4,
        n_fetch=4, run="mnist-example", token=a.token,
    )  # fmt: skip
    data = DataClient(a.dataservers.split(","), opt.conn.remote.client.token or "")
    test_x, test_y = heldout(data)
    for epoch in range(1, a.epochs + 1):
        for x, y in dataserver_batches(data.epoch(0, 1, epoch, batch_size=32)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        opt.flush()
        with torch.no_grad():
            acc = (model(test_x).argmax(1) == test_y).float().mean().item()
        print(f"epoch {epoch}: held-out accuracy {acc:.4f}")
    torch.save(opt.model_state_dict(), "mnist.pt")  # the servers' values
    opt.close()


if __name__ == "__main__":
    main()
