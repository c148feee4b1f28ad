"""The practitioner's workflow (issue 37), as a user runs it from the docs: `adamps up --detach`,
then docs/training.md's "Launching replicas" script as `adamps launch -n 2 train.py` (a
DownpourOptimizer given no controllers and no token, a DistributedSampler given the launcher's
rank and world size), then `adamps status`, `status --run`, `export --format torch --run`,
`checkpoint save` with no address and no token flag, then `adamps down`. HOME and
XDG_CONFIG_HOME point into the test's directory: the user's real config is not touched."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from adamps.up.procs import adamps_argv

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


EMB = """
import torch
from torch import nn
import adamps.torch as at

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = at.Embedding(None, 4, table="items")
        self.head = nn.Linear(4, 1)

    def forward(self, ids):
        return self.head(self.emb(ids))

model = Net()
opt = at.DownpourOptimizer(model, lr=0.1)
opt.zero_grad()
model(torch.arange(20)).pow(2).mean().backward()
opt.step()
opt.close()
"""


def example() -> str:
    text = (ROOT / "docs" / "training.md").read_text()
    section = text.split("## Launching replicas", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def user_env(tmp: Path) -> dict[str, str]:
    """This process's environment without any adamps setting (a user's shell), its config
    folders in `tmp`."""
    keep = {"ADAMPS_FREE_PORT_RANGE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_") or k in keep}
    env.update(HOME=str(tmp / "home"), XDG_CONFIG_HOME=str(tmp / "config"),
               OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT))  # fmt: skip
    return env


def adamps(env: dict[str, str], cwd: Path, *args: str, timeout: float = 120):  # type: ignore[no-untyped-def]
    return subprocess.run(adamps_argv(*args), cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # exited, not reaped yet
    except OSError:
        return True


def test_launch_two_replicas_against_a_detached_cluster(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    cluster_file = tmp_path / "config" / "adamps" / "clusters" / "local.json"
    pids: list[int] = []
    up = adamps(env, tmp_path, "up", "--detach", "--controllers", "1", "--servers", "2",
                "--dataservers", "0", "--buckets", "8", "--run-dir", str(tmp_path / "run"))  # fmt: skip
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "adamps down" in up.stdout and str(cluster_file) in up.stdout
        assert stat.S_IMODE(cluster_file.stat().st_mode) == 0o600
        info = json.loads(cluster_file.read_text())
        assert info["token_file"] == str(tmp_path / "run" / "token")
        pids = [e["pid"] for e in info["pids"].values()]
        assert len(pids) == 3 and not any(gone(p) for p in pids)  # they outlived `adamps up`
        again = adamps(env, tmp_path, "up", "--detach", "--run-dir", str(tmp_path / "run2"))
        assert again.returncode == 2 and "cluster 'local' is running" in again.stderr, again.stderr
        assert not (tmp_path / "run2").exists()  # refused before anything started
        bad = adamps(env, tmp_path, "up", "--detach", "--name", "../x")
        assert bad.returncode == 2 and "--name: cluster name '../x'" in bad.stderr, bad.stderr

        # an operator's run with a quota (its name: the script's), before the replicas start
        made = adamps(env, tmp_path, "run", "create", "train", "--param-elems", "1000")
        assert made.returncode == 0, made.stderr
        (tmp_path / "train.py").write_text(example())
        run = adamps(env, tmp_path, "launch", "-n", "2", "train.py", timeout=400)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        accs = dict(re.findall(r"replica (\d) of 2: accuracy (\S+)", run.stdout))
        assert set(accs) == {"0", "1"}, run.stdout
        assert all(float(a) >= 0.8 for a in accs.values()), accs
        assert run.stdout.rstrip().splitlines()[-1] == (
            "adamps launch: all 2 replicas finished (0 restarts)"
        )

        st = adamps(env, tmp_path, "status")
        assert st.returncode == 0, st.stderr
        assert "ps0" in st.stdout and "ps1" in st.stdout
        ctl = info["controllers"][0]
        with urllib.request.urlopen(f"http://{ctl}/layout", timeout=10) as resp:
            layout = json.loads(resp.read())["layout"]
        names = {t["name"] for t in layout["tensors"]}
        assert names == {  # one placement group (docs/training.md)
            "train..{0}0.weight",
            "train..{0}0.bias",
            "train..{0}2.weight",
            "train..{0}2.bias",
        }
        one = adamps(env, tmp_path, "status", "--run", "train")
        assert one.returncode == 0, one.stderr
        assert re.search(r"train\.\.\{0\}0\.weight\s+32x16\s+1 \(\d+\)\s+ps[01]", one.stdout), (
            one.stdout
        )
        assert "parameter elements 610 (61% of the quota 1000)" in one.stdout, one.stdout

        # a run with a table: `status --run` lists it with the buckets its primaries hold
        (tmp_path / "emb.py").write_text(EMB)
        emb = adamps(env, tmp_path, "launch", "-n", "1", "--run", "emb", "emb.py", timeout=200)
        assert emb.returncode == 0, emb.stderr[-3000:]
        tab = adamps(env, tmp_path, "status", "--run", "emb")
        assert re.search(r"emb\.\.items\s+4\s+20\s+\d+ \(", tab.stdout), tab.stdout
        assert "emb..{0}head.weight" in tab.stdout

        out = tmp_path / "model.pt"
        ex = adamps(
            env, tmp_path, "export", "--format", "torch", "--run", "train", "--out", str(out)
        )
        assert ex.returncode == 0, ex.stderr
        assert set(torch.load(out)) == {"0.weight", "0.bias", "2.weight", "2.bias"}
        ck = adamps(env, tmp_path, "checkpoint", "save", "--to", str(tmp_path / "ck"))
        assert ck.returncode == 0, ck.stderr
        manifest = json.loads((tmp_path / "ck" / "manifest.json").read_text())
        assert "train..{0}0.weight" in json.dumps(manifest)  # the server names

        # a wrong token: the error says where it came from and where the cluster's token is
        bad = adamps(env, tmp_path, "drain", "ps0", "--token", "f" * 64)
        assert bad.returncode == 1
        assert "unauthorized" in bad.stderr and "came from --token" in bad.stderr, bad.stderr
        assert f"cluster 'local' is in {tmp_path / 'run' / 'token'}" in bad.stderr, bad.stderr
    finally:
        down = adamps(env, tmp_path, "down", timeout=60)
    assert down.returncode == 0, down.stderr
    assert "cluster 'local' stopped (3 processes)" in down.stdout
    assert not cluster_file.exists()
    deadline = time.monotonic() + 15
    while not all(gone(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(gone(p) for p in pids)
    again = adamps(env, tmp_path, "down")
    assert again.returncode == 1 and "no cluster 'local'" in again.stderr


@pytest.mark.parametrize("where", ["default", "controllers"])
def test_launch_with_no_cluster_running_says_so_and_starts_nothing(
    tmp_path: Path, where: str
) -> None:
    """`adamps launch` before `adamps up --detach` (no cluster file), or at controllers that do
    not answer: exit 2 and one line naming the address and what to do, before any replica
    starts. Before, every replica started, failed with a traceback, was restarted 3 times, and
    the launcher exited 1."""
    from adamps.up.procs import free_port

    env = user_env(tmp_path)
    (tmp_path / "train.py").write_text("open('started', 'w').close()\nraise SystemExit(1)\n")
    addr = f"127.0.0.1:{free_port()}"
    flags = ["--controllers", addr] if where == "controllers" else []
    if where == "default":
        addr = "127.0.0.1:7000"
        try:  # the test needs nothing to answer there
            urllib.request.urlopen(f"http://{addr}/healthz", timeout=1)
            pytest.skip(f"something answers at {addr}")
        except OSError:
            pass
    p = adamps(env, tmp_path, "launch", "-n", "2", *flags, "train.py", timeout=60)
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert f"no controller answered at {addr}" in p.stderr, p.stderr
    assert "adamps up --detach" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr
    assert not (tmp_path / "started").exists()  # no replica ran
