"""The mistakes a user makes at the command line, tried as a user types them (an outside tester,
issue skeptic20): a cluster address without a port or with a bad one, a timeout of the wrong
sign or NaN, a number out of range in a role's configuration, Ctrl-C while a command waits on a
controller, a run name that does not exist. Each gets one line naming the bad value and what is
expected, exit code 2 for a usage error (130 after Ctrl-C), no traceback, nothing left behind.

The commands run as processes (`python -m adamps ...`) with a configuration home of their own;
no cluster is needed: a bad value is refused before any request, and "a controller that does
not answer" is a socket here that accepts and never replies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adamps.up.procs import adamps_argv

pytestmark = pytest.mark.timeout(240)


def env_for(tmp: Path) -> dict[str, str]:
    keep = {"ADAMPS_FREE_PORT_RANGE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_") or k in keep}
    env.update(HOME=str(tmp / "home"), XDG_CONFIG_HOME=str(tmp / "config"))
    return env


def adamps(tmp: Path, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(adamps_argv(*args), cwd=tmp, env=env_for(tmp), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


@pytest.fixture
def silent() -> Iterator[str]:
    """host:port of a socket that accepts connections and never answers (a hung controller)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


def test_adamps_without_a_command_is_a_usage_error(tmp_path: Path) -> None:
    out = adamps(tmp_path)
    assert out.returncode == 2 and "usage: adamps COMMAND" in out.stderr


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--controllers", "localhost"],  # no port: it asked port 80
        ["status", "--controllers", "127.0.0.1:99999"],
        ["drain", "ps-1", "--controllers", "127.0.0.1:notaport"],  # a traceback
        ["undrain", "ps-1", "--controllers", "127.0.0.1:99999"],  # a traceback
        ["run", "list", "--controllers", "c0:7000,c1"],
        ["checkpoint", "save", "--to", "ck", "--controllers", "127.0.0.1:x"],  # a traceback
        ["export", "--out", "m.npz", "--controllers", "http://127.0.0.1"],
        ["table", "load", "--table", "t", "--from", "x.npy", "--controllers", "h:0"],
        ["launch", "-n", "1", "--controllers", "foo:bar", "job.py"],
    ],
)
def test_a_bad_controller_address_is_named(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "job.py").write_text("")
    out = adamps(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    assert "expected HOST:PORT or http(s)://HOST:PORT" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--timeout", "nan"],  # ignored: every controller was "unreachable"
        ["drain", "ps-1", "--timeout", "-1"],  # a traceback: Timeout value out of range
        ["undrain", "ps-1", "--timeout", "nan"],
        ["run", "list", "--timeout", "0"],
        ["down", "--stop-timeout", "nan"],  # checked after the cluster file: exit code 1
        ["launch", "-n", "1", "--stop-timeout", "inf", "job.py"],
    ],
)
def test_a_timeout_that_is_no_number_of_seconds_is_named(tmp_path: Path, args: list[str]) -> None:
    (tmp_path / "job.py").write_text("")
    out = adamps(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    assert "expected a number of seconds > 0" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(
    "args, named",
    [
        (["ps", "--port", "-1"], "expected a port number in 0..65535"),  # bind() traceback
        (["ps", "--flush-interval", "nan"], "expected a finite number"),  # it ran
        (["ps", "--flush-interval", "inf"], "expected a finite number"),  # it ran, never flushing
        (["ps", "--max-shard-elems", "-1"], "expected an integer >= 0"),  # a traceback
        (["ps", "--max-shard-elems", "0"], "max_shard_elems must be >= 1"),
        (["ps", "--map-size", "-1"], "expected an integer >= 0"),  # a traceback
        (["dataserver", "--seed", "-1"], "expected an integer >= 0"),  # a traceback
        (["dataserver", "--port", "-1"], "expected a port number"),
        (["controller", "--lease-duration", "0"], "lease duration must be > 0"),  # a traceback
        (["controller", "--lease-skew", "5"], "lease skew must be in [0, 1)"),  # a traceback
        (["controller", "--idle-timeout", "0"], "idle_timeout must be a finite number > 0"),
        (["controller", "--leader-fallback", "0.01"], "leader_fallback must exceed"),  # assert
        (["controller", "--compaction-entries", "1"], "compaction_entries must be >= 2"),
        (["controller", "--max-servers", "-1"], "expected an integer >= 0"),  # it ran
        (["train", "--ps", "http://127.0.0.1:9", "--epochs", "-2"], "expected an integer >= 0"),
    ],
)
def test_a_role_value_out_of_range_stops_it_with_a_message(
    tmp_path: Path, args: list[str], named: str
) -> None:
    role, *rest = args
    if role == "controller":
        rest += ["--members", "127.0.0.1:9:10", "--member", "0"]
    if role in ("ps", "controller"):
        rest += ["--data-dir", str(tmp_path / "data")]
    out = adamps(tmp_path, role, *rest)
    assert out.returncode == 2, out.stderr[-2000:]
    assert named in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_negative_values_that_mean_something_are_still_taken(tmp_path: Path) -> None:
    """-1 is "not given" or "off" where a field says so (replica, partition, job_index,
    metrics_port); the rule "at least 0" is every other number's."""
    from adamps.config import load
    from trainer.config import TrainConfig

    cfg = load(TrainConfig, "train", {"metrics_port": "-1", "replica": "-1", "run": "r",
               "ps": "http://127.0.0.1:9", "token": "t" * 32})  # fmt: skip
    assert cfg.metrics_port == -1


def _interrupted(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    p = subprocess.Popen(
        adamps_argv(*args), cwd=tmp, env=env_for(tmp), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
        # a background job of a shell ignores SIGINT; a terminal's foreground job does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    time.sleep(4)  # imports, then the request that never gets an answer
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.mark.parametrize(
    "args",
    [
        ["status", "--timeout", "60"],
        ["run", "list", "--timeout", "60"],
        ["checkpoint", "save", "--to", "ck"],
    ],  # fmt: skip
)
def test_ctrl_c_while_a_controller_does_not_answer(
    tmp_path: Path, silent: str, args: list[str]
) -> None:
    out = _interrupted(tmp_path, *args, "--controllers", silent)
    assert out.returncode == 130, out.stderr[-2000:]
    assert "interrupted (Ctrl-C)" in out.stderr
    assert "Traceback" not in out.stderr and "KeyboardInterrupt" not in out.stderr
    assert not (tmp_path / "ck").exists()  # the save removes the directory it made


def test_a_failed_save_leaves_no_directory(tmp_path: Path) -> None:
    out = adamps(tmp_path, "checkpoint", "save", "--to", "ck", "--controllers", "127.0.0.1:9")
    assert out.returncode == 1 and "no controller answered" in out.stderr, out.stderr
    assert not (tmp_path / "ck").exists()


def test_up_with_a_run_dir_that_is_a_file_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("")
    for run_dir in ("f", "f/sub"):
        out = adamps(tmp_path, "up", "--detach", "--dataservers", "0", "--run-dir", run_dir)
        assert out.returncode == 2, out.stderr
        assert f"--run-dir {run_dir}:" in out.stderr and "Traceback" not in out.stderr


def test_table_load_checks_its_optimizer_before_reading_or_sending(tmp_path: Path) -> None:
    out = adamps(tmp_path, "table", "load", "--table", "t", "--from", "nosuch.npy",
                 "--controllers", "127.0.0.1:9", "--optimizer", '{"kind": "adam"}')  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "a table's optimizer must be one of" in out.stderr


def test_export_run_without_torch_is_refused(tmp_path: Path) -> None:
    """It was ignored: every run's tensors went to the file, exit code 0."""
    out = adamps(tmp_path, "export", "--from", "ck", "--run", "a", "--out", "m.npz")
    assert out.returncode == 2 and "--run a: expected with --format torch only" in out.stderr


def test_a_missing_token_is_named_once(tmp_path: Path) -> None:
    out = adamps(tmp_path, "drain", "ps-1", "--controllers", "10.255.255.1:7000")
    assert out.returncode == 2
    assert out.stderr.startswith("adamps drain: no cluster token"), out.stderr
