"""docs/operations.md's "Add a server" against a cluster of `adamps up --detach`, as an operator
types it: `adamps up` prints the command (the cluster token and the peer token are files of the
run directory, mode 0600), and a server started with it registers and receives buckets. Before,
the peer token of an `adamps up` cluster lived only in the controllers' environment, and a server
started by hand was refused at register for lacking its own key."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from adamps.up.procs import adamps_argv, free_port
from tests.polling import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def user_env(tmp: Path) -> dict[str, str]:
    keep = {"ADAMPS_FREE_PORT_RANGE"}
    env = {k: v for k, v in os.environ.items() if not k.startswith("ADAMPS_") or k in keep}
    env.update(HOME=str(tmp / "home"), XDG_CONFIG_HOME=str(tmp / "config"),
               OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(ROOT),
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")  # fmt: skip
    return env


def cluster_view(ctl: str) -> dict:
    with urllib.request.urlopen(f"http://{ctl}/cluster", timeout=5) as resp:
        return json.loads(resp.read())


def test_the_printed_add_a_server_command_adds_a_server(tmp_path: Path) -> None:
    env = user_env(tmp_path)
    run = tmp_path / "run"
    up = subprocess.run(
        adamps_argv("up", "--detach", "--controllers", "1", "--servers", "2", "--dataservers",
                    "0", "--buckets", "8", "--run-dir", str(run)),
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    ps = None
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert stat.S_IMODE((run / "peer-token").stat().st_mode) == 0o600
        info = json.loads((tmp_path / "config" / "adamps" / "clusters" / "local.json").read_text())
        assert info["peer_token_file"] == str(run / "peer-token")
        line = re.search(r"add a server: (.*)", up.stdout)
        assert line, up.stdout
        command = line.group(1)
        assert "--server-id ps2" in command and "--n-buckets 8" in command
        # the printed command, on ports of this test's range (the defaults may be taken here)
        ports = f" --port {free_port()} --data-port {free_port()}"
        ps = subprocess.Popen(["bash", "-c", command + ports], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
        ctl = info["controllers"][0]

        def holds_buckets() -> bool:
            assert ps is not None and ps.poll() is None, ps.stderr.read() if ps else ""
            view = cluster_view(ctl)
            live = view["servers"].get("ps2", {}).get("state") == "live"
            held = [b["bucket"] for b in view["buckets"]
                    if b["primary"] == "ps2" or "ps2" in b["secondaries"]]  # fmt: skip
            return live and held

        # buckets move to it: with 3 servers at RF 2 (min(3, 2 servers)) some copy lands there
        wait_for(holds_buckets, timeout=90, what="ps2 registered, live and holding buckets")
        st = subprocess.run(adamps_argv("status"), env=env, cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)  # fmt: skip
        assert st.returncode == 0 and "ps2" in st.stdout, st.stdout + st.stderr
    finally:
        if ps is not None and ps.poll() is None:
            os.killpg(ps.pid, signal.SIGTERM)
            ps.wait(timeout=30)
        down = subprocess.run(adamps_argv("down"), env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
    assert down.returncode == 0, down.stderr
