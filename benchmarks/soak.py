"""Soak: the nemesis of tests/chaos over many seeds for a given time (issue 11).

Each seed runs a fresh cluster (3 controllers, 3 parameter servers on loopback) under exactness
load through a random schedule of crashes, pauses, restarts with and without LMDB, controller
leader kills, drains, adds and rebalances, then heals and checks: every acknowledged push present
exactly once (except inside the loss window of a crash of every copy), failed ones absent,
unknown ones at most once, equal digests on every copy. Prints one line per seed (faults
injected, pushes acknowledged/failed/unknown checked, pass or fail) and, last, one JSON line
with the totals.

    python benchmarks/soak.py                     # 1 hour, random seeds, 60 s schedules
    python benchmarks/soak.py --duration 600 --seconds 45 --seed 100   # seeds 100, 101, ...
    python benchmarks/soak.py --faults kill1,pause1,leader_kill,add,rebalance

A failing seed reproduces with `ADAMPS_NEMESIS_SEED=<seed> python -m pytest
tests/chaos/test_nemesis.py`; its run directory (logs, nemesis.json) is kept under --run-dir.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.chaos.nemesis import run_nemesis  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="seconds to soak (default 1 h)")
    p.add_argument("--seconds", type=float, default=60.0, help="planned fault seconds per seed")
    p.add_argument("--seed", type=int, default=None, help="first seed (default random); +1 each")
    p.add_argument("--faults", default="", help="comma-separated step kinds (default all)")
    p.add_argument("--run-dir", default="", help="where failing runs are kept (default a tmp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run directories of passing seeds")
    p.add_argument("--verbose", action="store_true", help="print the nemesis history as it runs")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.faults.split(",") if k.strip()) or None
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="adamps-soak-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(
        f"soak for {args.duration:.0f}s, {args.seconds:.0f}s schedules, from seed {seed}; runs in {run_dir}"
    )
    totals = {"seeds": 0, "seeds_passed": 0, "seeds_failed": 0, "faults": 0, "acked": 0,
              "failed": 0, "unknown": 0, "skipped_steps": 0, "failing_seeds": [],
              "seeds_run": []}  # fmt: skip
    start = time.monotonic()
    while time.monotonic() - start < args.duration:
        root = run_dir / f"seed-{seed}"
        t0 = time.monotonic()
        echo = print if args.verbose else None
        try:
            report = run_nemesis(root, seed, args.seconds, kinds, echo=echo)
            ok, counts, faults, detail = True, report.counts, report.faults, ""
            skipped = report.skipped
        except Exception as exc:  # noqa: BLE001 - a seed that errors is reported, the soak goes on
            ok, counts, faults, skipped = False, {}, -1, 0
            detail = str(exc) if isinstance(exc, AssertionError) else f"{type(exc).__name__}: {exc}"
            try:  # the report written at the end of the run has the fault count
                data = json.loads((root / "nemesis.json").read_text())
                faults, skipped = data["faults"], data["skipped"]
            except (OSError, ValueError, KeyError):
                pass
        totals["seeds"] += 1
        totals["seeds_run"].append(seed)
        totals["faults"] += max(faults, 0)
        totals["skipped_steps"] += skipped
        if ok:
            totals["seeds_passed"] += 1
            totals["acked"] += counts["acked"]
            totals["failed"] += counts["failed"]
            totals["unknown"] += counts["unknown"]
            print(
                f"seed {seed}: PASS  faults {faults:3d}  acked {counts['acked']:6d}  "
                f"failed {counts['failed']:4d}  unknown {counts['unknown']:4d}  "
                f"(in loss windows {counts['acked_in_loss_windows']}, lost there "
                f"{counts['lost_in_loss_windows']})  {time.monotonic() - t0:5.1f}s",
                flush=True,
            )
            if not args.keep:
                shutil.rmtree(root, ignore_errors=True)
        else:
            root.mkdir(parents=True, exist_ok=True)
            (root / "failure.txt").write_text(detail)
            totals["seeds_failed"] += 1
            totals["failing_seeds"].append(seed)
            print(f"seed {seed}: FAIL  faults {faults:3d}  {time.monotonic() - t0:5.1f}s  "
                  f"(logs in {root})\n{detail}", flush=True)  # fmt: skip
        seed += 1
    totals["seconds"] = round(time.monotonic() - start, 1)
    print(json.dumps(totals))
    return 0 if totals["seeds_failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
