"""`python benchmarks/practitioner.py --quick` runs as a user runs it (issue 36: the smoke run in CI):
real clusters, real replicas, plain PyTorch beside them; it exits 0, its last line is one JSON
object with the issue's keys for what it ran, both the plain and the adamps runs learnt, and it
leaves no cluster directory behind. No figure is asserted beyond "it learnt": a test asserts no
speed (docs/benchmarks.md quotes the full run)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]


def test_the_quick_practitioner_run_prints_its_figures_and_cleans_up(tmp_path: Path) -> None:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    cmd = [sys.executable, "benchmarks/practitioner.py", "--quick", "--only", "transformer,idle",
           "--idle-seconds", "2"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    for key in ("transformer_rf3_2rep_cluster_ratio", "transformer_2rep_acc_gap_pp",
                "idle_cluster_cpu_s_per_s"):  # fmt: skip
        assert isinstance(figures.get(key), float) and math.isfinite(figures[key]), (key, figures)
    assert figures["transformer_rf3_2rep_cluster_ratio"] > 0
    assert figures["idle_cluster_cpu_s_per_s"] >= 0
    # one pass over 4,000 images: plain PyTorch and one adamps replica both learn (a broken push
    # path or evaluation stays near 10 %)
    assert figures["transformer_plain_acc"] > 0.6, figures
    assert figures["transformer_1rep_acc"] > 0.6, figures
    assert not list(tmp_path.glob("adamps-practitioner-*")), "the clusters' directories remain"


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    for args, named in ((["--epochs", "ctr=3"], "--epochs"), (["--seeds", "0"], "--seeds"),
                        (["--only", "resnet"], "resnet")):  # fmt: skip
        proc = subprocess.run([sys.executable, "benchmarks/practitioner.py", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)  # fmt: skip
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert named in proc.stderr, (args, proc.stderr)
