"""`adamps launch` as a process supervisor (issue 37): the environment each replica gets (torchrun's
names and the cluster's), a failing replica restarted alone within --max-restarts, the exit code
and last line saying what happened, SIGTERM stopping every replica, bad input refused. The
replicas are small python scripts: nothing here needs a cluster (the cluster's own part is
tests/pytorch/test_launch_detached.py), only an address whose /healthz answers, as a
controller's does: the launcher refuses controllers that do not answer (exit 2, before any
replica starts; tested there)."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from adamps.up.procs import adamps_argv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

SCRIPT = """
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "ADAMPS_CONTROLLERS", "ADAMPS_RUN", "ADAMPS_CLUSTER",
        "ADAMPS_TOKEN_FILE")
env = {k: os.environ.get(k) for k in keys}
out = os.path.join(sys.argv[1], f"rank{env['RANK']}-{env['TORCHELASTIC_RESTART_COUNT']}.json")
with open(out, "w") as f:
    json.dump({**env, "argv": sys.argv[2:]}, f)
fail_until = int(sys.argv[2])  # replica 1 fails its first FAIL_UNTIL runs with exit code 3
sys.exit(3 if env["RANK"] == "1" and int(env["TORCHELASTIC_RESTART_COUNT"]) < fail_until else 0)
"""


class _Healthz(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b'{"ok": true}'
        self.send_response(200 if self.path == "/healthz" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def ctl() -> Iterator[str]:
    """An address answering /healthz on loopback, where the replicas are told the controllers
    are (they contact nothing)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Healthz)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def env_for(tmp: Path) -> dict[str, str]:
    keep = {"ADAMPS_FREE_PORT_RANGE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_") or k in keep}
    env.update(HOME=str(tmp / "home"), XDG_CONFIG_HOME=str(tmp / "config"))
    return env


def launch(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(adamps_argv("launch", *args), cwd=tmp, env=env_for(tmp),
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_each_replica_gets_its_rank_and_the_cluster(tmp_path: Path, ctl: str) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    # a cluster file as `adamps up --detach --name lab` writes it (nothing is contacted)
    cfg = tmp_path / "config" / "adamps" / "clusters"
    cfg.mkdir(parents=True)
    (cfg / "lab.json").write_text(json.dumps({"name": "lab", "controllers": [ctl],
                                              "token_file": "/x/token"}))  # fmt: skip
    out = launch(tmp_path, "-n", "3", "--cluster", "lab", "job.py", str(tmp_path), "0", "--x")
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.rstrip().splitlines()[-1]
        == "adamps launch: all 3 replicas finished (0 restarts)"
    )
    seen = [json.loads((tmp_path / f"rank{r}-0.json").read_text()) for r in range(3)]
    for r, e in enumerate(seen):
        assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
            str(r), str(r), "3", "3")  # fmt: skip
        assert e["ADAMPS_CONTROLLERS"] == ctl and e["ADAMPS_CLUSTER"] == "lab"
        assert e["ADAMPS_TOKEN_FILE"] == "/x/token" and e["ADAMPS_RUN"] == "job"
        assert e["MASTER_ADDR"] == "127.0.0.1" and int(e["MASTER_PORT"]) > 0
        assert e["argv"] == ["0", "--x"]  # the script's own flags pass through


def test_a_failing_replica_is_restarted_alone_within_the_limit(tmp_path: Path, ctl: str) -> None:
    (tmp_path / "job.py").write_text(SCRIPT)
    env = ["--controllers", ctl]
    ok = launch(tmp_path, "-n", "2", "--max-restarts", "2", *env, "job.py", str(tmp_path), "2")
    assert ok.returncode == 0, ok.stderr
    assert ok.stderr.count("replica 1 exited with 3; restart") == 2
    assert (
        ok.stdout.rstrip().splitlines()[-1] == "adamps launch: all 2 replicas finished (2 restarts)"
    )
    assert sorted(p.name for p in tmp_path.glob("rank*.json")) == [
        "rank0-0.json", "rank1-0.json", "rank1-1.json", "rank1-2.json"]  # fmt: skip

    for p in tmp_path.glob("rank*.json"):
        p.unlink()
    bad = launch(tmp_path, "-n", "2", "--max-restarts", "1", *env, "job.py", str(tmp_path), "5")
    assert bad.returncode == 3, bad.stderr  # the failing replica's own exit code
    assert bad.stderr.rstrip().splitlines()[-1] == (
        "adamps launch: replica 1 failed with exit code 3 after 1 restart; stopped the others"
    )


def test_sigterm_stops_every_replica(tmp_path: Path, ctl: str) -> None:
    (tmp_path / "sleep.py").write_text(
        "import os, sys, time\n"
        "open(os.path.join(sys.argv[1], os.environ['RANK'] + '.pid'), 'w').write(str(os.getpid()))\n"
        "time.sleep(300)\n"
    )
    p = subprocess.Popen(adamps_argv("launch", "-n", "2", "--controllers", ctl,
                                     "sleep.py", str(tmp_path)),
                         cwd=tmp_path, env=env_for(tmp_path), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(f.read_text()) for f in tmp_path.glob("*.pid")]
        assert len(pids) == 2
        p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 128 + signal.SIGTERM, err
    assert "SIGTERM: stopped every replica" in err
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-n", "0", "job.py"], "-n 0: expected a number of replicas >= 1"),
        (["-n", "2", "nosuch.py"], "nosuch.py: no such file"),
        (["-n", "2", "--max-restarts", "-1", "job.py"], "--max-restarts -1: expected"),
        (["-n", "2", "--cluster", "nope", "job.py"], "no cluster 'nope'"),
        (["-n", "2", "--run", "a b", "job.py"], "a run's name must be"),
    ],
)
def test_bad_input_is_refused_with_exit_code_2(
    tmp_path: Path, args: list[str], message: str
) -> None:
    (tmp_path / "job.py").write_text("raise SystemExit(9)\n")
    out = launch(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    assert message in out.stderr
    assert not list(tmp_path.glob("*.pid"))
