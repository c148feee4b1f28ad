"""docs/training.md, "torch.optim optimizers": AdamW with two param groups, a OneCycleLR
schedule and bfloat16 autocast, trained on the parameter servers and resumable from
``opt.state_dict()``. Run with ``adamps launch -n 2 examples/torch_onecycle.py`` against
``adamps up --detach`` (tests/pytorch/test_onecycle_docs.py runs the docs' copy as written)."""

import argparse
import os

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import adamps.torch

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--stop-after", type=int, default=0, help="stop after this epoch (0: never)")
args = parser.parse_args()
rank, world = adamps.torch.rank(), adamps.torch.world_size()

torch.manual_seed(0)  # every replica draws the same data set and initial model
x = torch.randn(2048, 16)
y = (x[:, :8].sum(1) > x[:, 8:].sum(1)).long()
data = TensorDataset(x, y)
sampler = DistributedSampler(data, num_replicas=world, rank=rank)
loader = DataLoader(data, batch_size=32, sampler=sampler)

model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 2))  # on "cpu"
opt = adamps.torch.AdamW(
    [
        {"params": model[0].parameters()},  # the body: lr and weight_decay below
        {"params": model[2].parameters(), "lr": 2e-3, "weight_decay": 0.0},  # the head
    ],
    model=model,  # names the server tensors: train..0.weight, ... (run: the script's name)
    lr=1e-3,
    weight_decay=0.01,
)
sched = torch.optim.lr_scheduler.OneCycleLR(
    opt, max_lr=[1e-2, 2e-2], epochs=args.epochs, steps_per_epoch=len(loader)
)

start = 0
checkpoint = f"checkpoint-{rank}.pt"
if os.path.exists(checkpoint):  # resume: the servers kept the weights and AdamW's moments
    saved = torch.load(checkpoint, weights_only=True)
    opt.load_state_dict(saved["opt"])  # each group's lr, betas, ...; the step count
    sched.load_state_dict(saved["sched"])
    start = saved["epoch"]

for epoch in range(start, args.epochs):
    sampler.set_epoch(epoch)
    for xb, yb in loader:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()  # the servers apply AdamW with each group's lr of this step
        sched.step()  # new lr (and beta1) in opt.param_groups: used from the next step
    state = {"opt": opt.state_dict(), "sched": sched.state_dict(), "epoch": epoch + 1}
    torch.save(state, checkpoint)
    print(f"replica {rank}: epoch {epoch + 1} step {opt.steps} lr {sched.get_last_lr()}")
    if epoch + 1 == args.stop_after:
        break
opt.flush()  # push what is left and fetch the servers' values
with torch.no_grad():
    accuracy = (model(x).argmax(1) == y).float().mean().item()
print(f"replica {rank} of {world}: accuracy {accuracy:.3f}")
opt.close()
