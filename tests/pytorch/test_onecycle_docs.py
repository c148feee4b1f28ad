"""Issue 37's first "done when", as a user runs it from docs/training.md ("torch.optim
optimizers"): the section's train.py (AdamW with two param groups, OneCycleLR, bfloat16 autocast,
a checkpoint per epoch from opt.state_dict()) and its commands, run as written: `adamps up
--detach`, `adamps launch -n 2 train.py --stop-after 2`, `adamps launch -n 2 train.py` (the
resume), `adamps down`. After each launch every server holding a copy of the run's tensors
reports the lr of the last update it applied: the schedule's lr of the last step, per group.
HOME and XDG_CONFIG_HOME point into the test's directory."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from adamps.client import routing_from_table
from adamps.client.rpc import SyncRpc, get_json
from tests.pytorch.test_launch_detached import adamps, user_env

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
SECTION = "## torch.optim optimizers"


def blocks() -> tuple[str, list[str]]:
    """The section's python block and its shell commands (comments removed)."""
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    sh = re.search(r"```sh\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]
    lines = [ln.split("#", 1)[0].strip() for ln in sh.splitlines()]
    return code, [ln for ln in lines if ln]


def schedule_lrs(steps_done: int) -> list[float]:
    """Each group's lr at step index `steps_done` (0-based) of the script's OneCycleLR."""
    ps = [torch.zeros(1, requires_grad=True), torch.zeros(1, requires_grad=True)]
    opt = torch.optim.AdamW([{"params": [ps[0]]}, {"params": [ps[1]], "lr": 2e-3}], lr=1e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[1e-2, 2e-2], epochs=4, steps_per_epoch=32
    )
    for _ in range(steps_done):
        opt.step()
        sched.step()
    return [g["lr"] for g in opt.param_groups]


def servers_lr(cluster: dict, tensor: str) -> list[float]:  # type: ignore[type-arg]
    """The lr of the last update applied to `tensor` by every server holding one of its shards."""
    token = Path(cluster["token_file"]).read_text().strip()
    table = get_json(cluster["controllers"][0], "/routing")
    seen = []
    for url in routing_from_table(table).servers():
        rpc = SyncRpc(url, token, 10.0)
        try:
            shards = rpc.call("describe", name=tensor)["shards"]
        finally:
            rpc.close()
        seen += [s["applied"]["lr"] for s in shards if s["held"]]
    return seen


def assert_applied(got: list[float], lr: float, tensor: str) -> None:
    """Every copy applied the step's lr, divided by 1 + tau as `staleness="auto"` divides an
    AdamW push tau updates stale (docs/training.md, "Several replicas"). The last push is
    usually the later replica's, after the other stopped (tau 0: the schedule's lr itself), but
    when both finish together it is stale: a loaded run read lr / 3 (tau 2). Any other value
    (an earlier step's lr, or the lr the tensors were created with) fails."""
    assert got and all(g > 0 for g in got), (tensor, got)
    taus = [lr / g - 1 for g in got]
    assert all(abs(t - round(t)) < 1e-6 and 0 <= round(t) <= 4 for t in taus), (tensor, got, lr)
    assert len(set(got)) == 1, (tensor, got)  # every copy applied the same last push


def test_the_docs_onecycle_script_trains_and_resumes(tmp_path: Path) -> None:
    code, commands = blocks()
    assert code in (ROOT / "examples" / "torch_onecycle.py").read_text()  # the same script
    assert [c.split()[:2] for c in commands] == [
        ["adamps", "up"], ["adamps", "launch"], ["adamps", "launch"], ["adamps", "down"]
    ]  # fmt: skip
    env = user_env(tmp_path)
    (tmp_path / "train.py").write_text(code)
    cluster_file = tmp_path / "config" / "adamps" / "clusters" / "local.json"
    up, first, second, down = (shlex.split(c)[1:] for c in commands)
    started = adamps(env, tmp_path, *up)
    try:
        assert started.returncode == 0, started.stdout + started.stderr
        cluster = json.loads(cluster_file.read_text())

        run = adamps(env, tmp_path, *first, timeout=400)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        for r in (0, 1):
            assert f"replica {r}: epoch 2 step 64 lr" in run.stdout, run.stdout
            assert f"replica {r}: epoch 3" not in run.stdout, run.stdout
        # the lr of each group's last step (index 63) is the one the servers applied last
        want = schedule_lrs(63)
        assert want[0] > 5e-3  # mid-cycle: far from the lr the tensors were created with
        for tensor, lr in (("train..{0}0.weight", want[0]), ("train..{0}2.bias", want[1])):
            assert_applied(servers_lr(cluster, tensor), lr, tensor)

        again = adamps(env, tmp_path, *second, timeout=400)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        for r in (0, 1):  # resumed at epoch 3 with the step count and the schedule
            assert f"replica {r}: epoch 1 " not in again.stdout, again.stdout
            assert f"replica {r}: epoch 3 step 96 lr" in again.stdout, again.stdout
            assert f"replica {r}: epoch 4 step 128 lr" in again.stdout, again.stdout
        accs = dict(re.findall(r"replica (\d) of 2: accuracy (\S+)", again.stdout))
        assert set(accs) == {"0", "1"} and all(float(a) >= 0.9 for a in accs.values()), accs
        want = schedule_lrs(127)
        for tensor, lr in (("train..{0}0.weight", want[0]), ("train..{0}2.bias", want[1])):
            assert_applied(servers_lr(cluster, tensor), lr, tensor)
    finally:
        stopped = adamps(env, tmp_path, *down, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert not cluster_file.exists()
