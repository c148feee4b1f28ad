"""The nemesis in CI: one seeded random schedule of about 60 s of faults against real processes.

Reference: issue 11 ("A nemesis in the project's own suite"), Jepsen's shape. The seed comes from
`ADAMPS_NEMESIS_SEED`, else, under CI (`CI` set), from seeds the soak passed (one per day,
`nemesis.CI_SEEDS`: a landing must not depend on a lottery), else random; it is printed first; `ADAMPS_NEMESIS_SECONDS` sets the
planned length of the schedule (default 60) and `ADAMPS_NEMESIS_FAULTS` restricts the step kinds
(comma separated, e.g. `kill1,pause1,leader_kill,add,rebalance`; default every kind). On failure
the assertion message holds the seed, the schedule and the timestamped history; the run directory
keeps every process's log and `nemesis.json`. benchmarks/soak.py runs the same over many seeds.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.chaos.nemesis import SINGLE, make_schedule, run_nemesis, seed_from_env


def faults_from_env() -> tuple[str, ...] | None:
    kinds = os.environ.get("ADAMPS_NEMESIS_FAULTS", "").strip()
    return tuple(k.strip() for k in kinds.split(",") if k.strip()) or None


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_random_schedule_of_faults_keeps_every_acknowledged_push(tmp_path: Path) -> None:
    seed = seed_from_env()
    duration = float(os.environ.get("ADAMPS_NEMESIS_SECONDS", "60"))
    print(f"ADAMPS_NEMESIS_SEED={seed}")
    report = run_nemesis(tmp_path, seed, duration, faults_from_env())
    print(report.text())
    assert report.faults >= 5, f"too few faults injected to mean anything:\n{report.text()}"
    assert report.counts["acked"] >= 500, report.counts


def test_schedules_are_reproducible_from_the_seed_and_respect_the_kinds() -> None:
    a, b = make_schedule(42, 60), make_schedule(42, 60)
    assert a == b and a != make_schedule(43, 60)
    assert sum(s.hold + s.gap for s in a) >= 60
    single = make_schedule(7, 120, SINGLE)
    assert {s.kind for s in single} <= {"kill", "pause", "leader_kill", "add", "rebalance"}
    assert all(s.n == 1 for s in single if s.kind in ("kill", "pause"))
    with pytest.raises(ValueError, match="unknown nemesis step"):
        make_schedule(1, 10, ("explode",))
