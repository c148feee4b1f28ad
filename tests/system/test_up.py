"""`adamps up` as a user runs it: a real process that starts the whole cluster as real processes.

Checks: a signal stops every child and every grandchild (no process of the run remains, found by
the PIDs it recorded, by session and by command line); a short real run exits 0 with the final
accuracy and a PNG plot; a missed accuracy target exits 1; bad flags exit 2 naming the value.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from adamps.up.plot import iteration_figure
from adamps.up.procs import adamps_argv, port_range

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def start_up(run: Path, *flags: str) -> tuple[subprocess.Popen[bytes], Path]:
    """`adamps up` in its own session (as from a shell), output to a file beside the run."""
    out = run.parent / f"{run.name}.out"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("ADAMPS_TOKEN", None)
    with open(out, "wb") as fh:
        proc = subprocess.Popen(
            adamps_argv("up", "--run-dir", str(run), "--no-progress", *flags),
            stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            cwd=ROOT, start_new_session=True,
        )  # fmt: skip
    return proc, out


def recorded_pids(run: Path) -> dict[str, int]:
    try:
        return json.loads((run / "pids.json").read_text())
    except (OSError, ValueError):
        return {}


def processes_of_run(run: Path, pids: dict[str, int]) -> dict[int, str]:
    """Live processes that belong to the run: a recorded PID, a member of a recorded child's
    session (workers of trainers and data servers), or a command line naming the run directory."""
    children = {pid for name, pid in pids.items() if name != "up"}
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        state, sid = fields[0], int(fields[3])
        if state == "Z":
            continue  # exited, waiting for its parent to reap it: not running
        if pid in children or sid in children or str(run) in cmdline:
            found[pid] = cmdline.strip()[:200]
    return found


def training(run: Path) -> bool:
    """The progress view has seen images/s > 0 (its readings are in progress.jsonl)."""
    try:
        lines = (run / "progress.jsonl").read_text().splitlines()
    except OSError:
        return False
    return any(json.loads(x)["images_per_s"] > 0 for x in lines if x.endswith("}"))


def wait_until(pred, timeout: float, what: str, proc: subprocess.Popen[bytes], out: Path) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if proc.poll() is not None:
            raise AssertionError(
                f"adamps up exited {proc.returncode} before {what}:\n{out.read_text()}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{out.read_text()}")
        time.sleep(0.1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("sig", "when"),
    [(signal.SIGTERM, "training"), (signal.SIGINT, "cluster start")],
    ids=["sigterm-while-training", "sigint-while-starting"],
)
def test_signal_stops_every_child(tmp_path: Path, sig: int, when: str) -> None:
    run = tmp_path / "run"
    proc, out = start_up(run, "--epochs", "200", "--stop-timeout", "5")
    try:
        if when == "training":
            # Both trainers started and training (their workers are grandchildren of `up`).
            wait_until(lambda: training(run), 120, "training progress", proc, out)
        else:
            wait_until(lambda: "ps0" in recorded_pids(run), 60, "the first PS start", proc, out)
        pids = recorded_pids(run)
        before = processes_of_run(run, pids)
        assert set(pids.values()) <= set(before), (pids, before)  # the check can see them
        if when == "training":
            assert len(before) > len(pids), before  # and their workers
        os.kill(proc.pid, sig)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert code == 128 + sig, text
    assert f"{signal.Signals(sig).name}: stopping every process" in text, text
    pids = recorded_pids(run)  # rewritten at the end: every child ever started
    left = processes_of_run(run, pids)
    assert not left, f"processes of the run still alive after `adamps up` exited: {left}\n{text}"
    assert "did not stop" not in text, text  # stopped by SIGTERM, not SIGKILL


@pytest.mark.timeout(150)
def test_a_dead_trainer_fails_the_run_and_everything_stops(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, out = start_up(run, "--epochs", "200", "--stop-timeout", "5")
    try:
        wait_until(lambda: training(run), 120, "training progress", proc, out)
        os.kill(recorded_pids(run)["train1"], signal.SIGKILL)  # its workers stay behind
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out.read_text()
    assert code == 1, text
    assert "train1 exited with -9" in text, text
    left = processes_of_run(run, recorded_pids(run))
    assert not left, f"processes of the run still alive: {left}\n{text}"


@pytest.mark.timeout(150)
def test_short_run_ends_with_accuracy_and_plot(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # below the kernel's ephemeral range, in this pytest-xdist worker's slice of it
    low, high = port_range()
    base = low + os.getpid() % (high - low - 100)
    t0 = time.monotonic()
    proc, out = start_up(run, "--epochs", "2", "--target-accuracy", "0.9", "--port-base", str(base))
    try:
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    wall = time.monotonic() - t0
    text = out.read_text()
    assert code == 0, text
    assert wall < 90, f"{wall:.0f} s\n{text}"

    acc = re.search(r"^held-out accuracy: ([0-9.]+)% after 2 epochs", text, re.M)
    assert acc and float(acc.group(1)) >= 90.0, text
    assert re.search(r"^throughput: [0-9,]+ images/s", text, re.M), text
    plot = Path(re.search(r"^plot: (.+)$", text, re.M).group(1))
    assert plot == run.resolve() / "training.png"
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    result = json.loads((run / "result.json").read_text())
    assert result["heldout_accuracy"] == pytest.approx(float(acc.group(1)) / 100, abs=1e-4)
    history = [json.loads(x) for x in (run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in history][-1] == 2

    # where everything is: every process's admin endpoint on the ports counted from --port-base
    ports = [int(p) for p in re.findall(r"^\s+\S+\s+http://127\.0\.0\.1:(\d+)", text, re.M)]
    assert len(ports) == 3 + 3 + 1 + 2, text
    assert all(base <= p < base + 100 for p in ports), ports
    names = {p.stem for p in (run / "logs").glob("*.log")}
    assert names == {"controller0", "controller1", "controller2", "ps0", "ps1", "ps2",
                     "dataserver0", "train0", "train1"}  # fmt: skip
    assert (run / "token").stat().st_mode & 0o777 == 0o600
    token = (run / "token").read_text().strip()
    assert len(token) == 64 and token not in text
    assert not processes_of_run(run, recorded_pids(run))


@pytest.mark.timeout(240)
def test_sandblaster_run_trains_through_a_coordinator(tmp_path: Path) -> None:
    """`adamps up --algorithm sandblaster`: a coordinator drives L-BFGS, the trainers compute
    portions, trainer 0 measures the held-out accuracy (docs/training.md states what 60
    iterations reach; 4 here only have to learn something)."""
    run = tmp_path / "run"
    proc, out = start_up(run, "--algorithm", "sandblaster", "--iterations", "4",
                         "--target-accuracy", "0.3")  # fmt: skip
    try:
        code = proc.wait(220)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    text = out.read_text()
    assert code == 0, text
    assert re.search(r"^held-out accuracy: [0-9.]+% after 4 L-BFGS iterations", text, re.M), text
    # The plot is per L-BFGS iteration (issue 26: it was empty and titled in epochs), from the
    # coordinator's line per iteration; matplotlib printed a legend warning.
    assert "No artists with labels" not in text, text
    recs = [json.loads(line) for line in (run / "iterations.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [1, 2, 3, 4], recs
    assert all(r["loss"] > 0 and 0.0 < r["heldout_accuracy"] <= 1.0 for r in recs), recs
    assert recs[-1]["heldout_accuracy"] > 0.3, recs  # learnt something, as the run's target
    fig = iteration_figure(recs, title="t")
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [1, 2, 3, 4]
    assert list(fig.axes[1].get_lines()[0].get_ydata()) == [
        100 * r["heldout_accuracy"] for r in recs
    ]
    assert (run / "training.png").stat().st_size > 0
    assert re.search(r"^\s+coordinator\s+http://127\.0\.0\.1:\d+", text, re.M), text
    assert "coordinator" in {p.stem for p in (run / "logs").glob("*.log")}
    assert not processes_of_run(run, recorded_pids(run))


@pytest.mark.timeout(120)
def test_missed_target_exits_1(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc, out = start_up(run, "--epochs", "1", "--target-accuracy", "0.999", "--trainers", "1",
                         "--servers", "1", "--controllers", "1")  # fmt: skip
    try:
        code = proc.wait(100)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    text = out.read_text()
    assert code == 1, text
    assert "is below --target-accuracy 0.999" in text, text
    assert (run / "training.png").exists()


@pytest.mark.timeout(150)
def test_up_with_tls_runs_every_process_over_tls(tmp_path: Path) -> None:
    """`adamps up --tls` (issue 28): a throwaway CA in RUN_DIR/tls, every process serving
    HTTPS (and TLS on the data ports), the trainer training through them."""
    run = tmp_path / "run"
    proc, out = start_up(run, "--epochs", "1", "--target-accuracy", "0", "--trainers", "1",
                         "--servers", "1", "--controllers", "1", "--tls")  # fmt: skip
    try:
        code = proc.wait(130)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
    text = out.read_text()
    assert code == 0, text
    assert "TLS on every port" in text and "https://127.0.0.1:" in text, text
    assert oct((run / "tls" / "key.pem").stat().st_mode & 0o777) == "0o600"
    logs = {p.stem: p.read_text() for p in (run / "logs").glob("*.log")}
    for name in ("controller0", "ps0", "dataserver0", "train0"):
        assert "://" in logs[name] and ("on https://" in logs[name]), (name, logs[name][-2000:])
    assert "data plane listening on 127.0.0.1" in logs["ps0"] and "(TLS)" in logs["ps0"]


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--servers", "0"], "--servers 0: expected an integer >= 1"),
        (["--trainers", "-1"], "--trainers -1: expected an integer >= 1"),
        (["--target-accuracy", "96"], "--target-accuracy 96.0: expected a fraction in [0, 1]"),
        (
            ["--port-base", "80"],
            "--port-base 80: expected 0 (any free ports) or a port in 1024..65000",
        ),
        (["--epochs", "many"], "argument --epochs: invalid int value: 'many'"),
        (["--compress-fraction", "2"], "--compress-fraction 2.0: expected a fraction in (0, 1]"),
        (["--compress-tau", "fc1.w=abc"], "--compress-tau fc1.w=abc: compress_tau entry"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--iterations", "0"], "--iterations 0: expected an integer >= 1"),
        (["--algorithm", "lbfgs"], "argument --algorithm: invalid choice: 'lbfgs'"),
    ],
)
def test_bad_flags_exit_2_naming_the_value(tmp_path: Path, flags: list[str], message: str) -> None:
    run = tmp_path / "run"
    res = subprocess.run(
        [*adamps_argv("up", "--run-dir", str(run)), *flags],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2, res
    assert message in res.stderr, res.stderr
    assert not run.exists()  # nothing started, nothing written


def test_non_empty_run_dir_is_refused(tmp_path: Path) -> None:
    (tmp_path / "old").write_text("x")
    res = subprocess.run(
        [*adamps_argv("up", "--run-dir", str(tmp_path))],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert res.returncode == 2, res
    assert f"--run-dir {tmp_path}: expected a new or empty directory" in res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
