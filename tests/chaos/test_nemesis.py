"""The nemesis in CI: one seeded random schedule of about 60 s of faults against real processes.

Reference: issue 11 ("A nemesis in the project's own suite"), Jepsen's shape. The seed comes from
`ADAMPS_NEMESIS_SEED` (else random) and is printed first; `ADAMPS_NEMESIS_SECONDS` sets the
planned length of the schedule (default 60) and `ADAMPS_NEMESIS_FAULTS` restricts the step kinds
(comma separated, e.g. `kill1,pause1,leader_kill,add,rebalance`; default every kind). On failure
the assertion message holds the seed, the schedule and the timestamped history; the run directory
keeps every process's log and `nemesis.json`. benchmarks/soak.py runs the same over many seeds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.nemesis import run_nemesis, seed_from_env

pytestmark = pytest.mark.slow


def faults_from_env() -> tuple[str, ...] | None:
    kinds = os.environ.get("ADAMPS_NEMESIS_FAULTS", "").strip()
    return tuple(k.strip() for k in kinds.split(",") if k.strip()) or None


@pytest.mark.timeout(330)
def test_random_schedule_of_faults_keeps_every_acknowledged_push(tmp_path: Path) -> None:
    seed = seed_from_env()
    duration = float(os.environ.get("ADAMPS_NEMESIS_SECONDS", "60"))
    print(f"ADAMPS_NEMESIS_SEED={seed}")
    report = run_nemesis(tmp_path, seed, duration, faults_from_env())
    print(report.text())
    assert report.faults >= 5, f"too few faults injected to mean anything:\n{report.text()}"
    assert report.counts["acked"] >= 500, report.counts
