"""`adamps up --detach` and `adamps down`: a cluster that outlives the command that started it,
found by name (adamps.clusters) and stopped by name.

A detached cluster's processes run in their own sessions (adamps.up.procs) and are started
without the parent-death signal (PROCS' ``PARENT_ENV``), so they keep running when `adamps up`
returns. Their PIDs and start times go into the cluster file: `adamps down` signals a PID only
while it is still the process that `adamps up` started (a PID reused by another process is left
alone).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from adamps import clusters
from adamps.client.rpc import http_json

#: the order `adamps down` stops them: parameter and data servers, then the controllers (a
#: parameter server's shutdown still talks to the controllers, as in `adamps up`)
STAGES = (("ps", "dataserver"), ("controller",))


def start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux /proc), None when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def check_free(name: str) -> None:
    """Raises ClusterError when cluster `name` is running (its file names a live controller)."""
    try:
        info = clusters.load(name)
    except clusters.ClusterError:
        return
    for addr in info["controllers"]:
        if http_json(f"http://{addr}/healthz", timeout=1.0)[0] == 200:
            raise clusters.ClusterError(
                f"cluster {name!r} is running (controller {addr} answers; "
                f"{clusters.cluster_file(name)}): stop it with `adamps down"
                f"{'' if name == clusters.DEFAULT_NAME else ' --cluster ' + name}` or choose "
                "another --name"
            )


def write_cluster_file(run: Any, name: str) -> str:
    """Writes the cluster file of the started `run` (adamps.up.main.Run); returns its path."""
    c = run.cluster
    info = {
        "controllers": list(c.controllers),
        "servers": dict(zip(c.server_ids, c.servers, strict=True)),
        "dataservers": [f"http://{d}" for d in c.dataservers],
        "run_dir": str(run.run),
        "token_file": str(run.run / "token"),
        **({"peer_token_file": str(run.run / "peer-token")} if c.peer_token else {}),
        "pids": {n: {"pid": p.pid, "start": start_time(p.pid)} for n, p in c.procs.items()},
        "created": time.time(),
    }
    if c.tls_files is not None:
        info["tls_ca"] = str(c.tls_files.ca)
    return str(clusters.write(name, info))


def usage_lines(name: str, path: str, run: Any) -> list[str]:
    flag = "" if name == clusters.DEFAULT_NAME else f" --cluster {name}"
    lines = [
        f"adamps up: cluster {name!r} left running; its file: {path}",
        f"  controllers {','.join(run.cluster.controllers)}; token in {run.run / 'token'}",
    ]
    if run.cluster.dataservers:
        lines.append(f"  data servers {','.join('http://' + d for d in run.cluster.dataservers)}")
    if run.cluster.tls_files is not None:
        lines.append(f"  clients: export ADAMPS_TLS_CA={run.cluster.tls_files.ca}")
    c = run.cluster
    if c.peer_token:
        new_id = f"ps{len(c.server_ids)}"
        lines.append(
            f"  add a server: ADAMPS_TOKEN=$(cat {run.run / 'token'}) "
            f"ADAMPS_PEER_TOKEN=$(cat {run.run / 'peer-token'}) adamps ps --controllers "
            f"{','.join(c.controllers)} --server-id {new_id} --n-buckets {c.n_buckets} "
            f"--data-dir {run.run / new_id}"
        )
    lines += [
        f"  train:  adamps launch -n 2{flag} train.py",
        f"  see:    adamps status{flag}",
        f"  stop:   adamps down{flag}",
    ]
    return lines


# -- adamps down -----------------------------------------------------------------------------------


def _ours(entry: dict[str, Any]) -> bool:
    pid = int(entry["pid"])
    now = start_time(pid)
    if now is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return False  # another user's process: not ours
        return entry.get("start") is None  # no /proc: trust the PID
    return entry.get("start") in (None, now)


def stop_stage(entries: list[tuple[str, dict[str, Any]]], timeout: float) -> list[str]:
    """SIGTERM to each process group, SIGKILL to those alive after `timeout`; their names."""
    live = [(n, int(e["pid"])) for n, e in entries if _ours(e)]
    for _n, pid in live:
        for sig in (signal.SIGCONT, signal.SIGTERM):  # a paused process cannot handle SIGTERM
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
    deadline = time.monotonic() + timeout
    for n, pid in live:
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if _alive(pid):
            print(f"adamps down: {n} did not stop within {timeout:g} s of SIGTERM: SIGKILL",
                  file=sys.stderr)  # fmt: skip
        try:
            os.killpg(pid, signal.SIGKILL)  # what is left of its group (workers)
        except (ProcessLookupError, PermissionError):
            pass
    return [n for n, _ in live]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adamps down",
        description="Stop a cluster started by `adamps up --detach` (SIGTERM to each process, "
        "SIGKILL after --stop-timeout) and remove its cluster file; the run directory (logs, "
        "data, token) is kept.",
    )
    p.add_argument(
        "--cluster",
        default=None,
        help=f"the cluster's name (default: $ADAMPS_CLUSTER, else {clusters.DEFAULT_NAME!r})",
    )
    p.add_argument(
        "--stop-timeout",
        type=clusters.seconds,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL, per stage (default: %(default)s)",
    )
    return p


def down_main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    name = args.cluster or os.environ.get("ADAMPS_CLUSTER") or clusters.DEFAULT_NAME
    try:
        info = clusters.load(name)
    except clusters.ClusterError as exc:
        print(f"adamps down: {exc}", file=sys.stderr)
        return 1
    pids = info.get("pids") or {}
    stopped: list[str] = []
    for prefixes in STAGES:
        stage = [(n, e) for n, e in pids.items() if n.startswith(prefixes)]
        stopped += stop_stage(stage, args.stop_timeout)
    clusters.cluster_file(name).unlink(missing_ok=True)
    print(
        f"adamps down: cluster {name!r} stopped ({len(stopped)} processes); its run directory "
        f"{info.get('run_dir')} is kept"
    )
    return 0
