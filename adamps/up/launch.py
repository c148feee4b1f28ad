"""`adamps launch -n N [--cluster NAME] script.py ARGS`: N replicas of a training script, as
torchrun starts them.

Each replica is ``python script.py ARGS`` with, in its environment, ``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` (torchrun's names; one machine, so RANK = LOCAL_RANK),
``MASTER_ADDR``/``MASTER_PORT`` (a free loopback port, for a script that also forms a
torch.distributed group), ``TORCHELASTIC_RESTART_COUNT``, and the cluster:
``ADAMPS_CONTROLLERS``, ``ADAMPS_TOKEN_FILE`` (the path of the token, never the token itself),
``ADAMPS_RUN`` and ``ADAMPS_CLUSTER``. ``adamps.torch`` reads them (adamps/torch/launch_env.py).

Downpour replicas are independent: a replica that exits non-zero is restarted alone (same
RANK), at most ``--max-restarts`` times each; the others keep training. Exit code: 0 when every
replica exited 0; otherwise the code of the first replica that failed past its restarts (the
others are then stopped); 128 + N after signal N (Ctrl-C: 130). The last line says which.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from adamps import clusters, runs
from adamps.client.rpc import get_json
from adamps.up.procs import free_port

_PR_SET_PDEATHSIG = 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="adamps launch",
        description="Start N replicas of a training script with RANK, WORLD_SIZE and the "
        "cluster's address, token file and run name in their environment (as torchrun does); "
        "restart a replica that fails, stop them all on Ctrl-C.",
    )
    p.add_argument("-n", "--nproc", type=int, required=True, help="replicas to start")
    p.add_argument(
        "--run",
        default=None,
        help="the run's name ($ADAMPS_RUN; its tensors are RUN..NAME; default: the script's "
        "file name without .py)",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=3,
        help="restarts of each replica that exits non-zero (default: %(default)s)",
    )
    p.add_argument(
        "--stop-timeout",
        type=clusters.seconds,
        default=10.0,
        help="seconds between SIGTERM and SIGKILL when stopping (default: %(default)s)",
    )
    clusters.add_arguments(p, token=False)
    p.add_argument("script", help="the training script (python)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    return p


def _die_with_launcher() -> None:
    """In the replica, before exec: SIGTERM when the launcher dies (Linux), even by SIGKILL."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Replica:
    def __init__(self, rank: int, argv: list[str], env: dict[str, str]) -> None:
        self.rank = rank
        self.argv = argv
        self.env = env
        self.restarts = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.code: int | None = None  #: its final exit code, once it will not be restarted

    def start(self) -> None:
        env = {**self.env, "TORCHELASTIC_RESTART_COUNT": str(self.restarts)}
        self.proc = subprocess.Popen(
            self.argv, env=env, start_new_session=True,
            preexec_fn=_die_with_launcher if sys.platform.startswith("linux") else None,
        )  # fmt: skip

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def reachable(addrs: list[str], args: argparse.Namespace, cluster: str | None) -> None:
    """ValueError unless one of the controllers answers ``/healthz``: with no cluster running
    (`adamps up --detach` forgotten, a stopped one), every replica would fail on its first
    request, be restarted ``--max-restarts`` times, each with a traceback, and the launcher exit
    1; one line before any replica starts says what is wrong instead."""
    errors = []
    for addr in addrs:
        try:
            get_json(addr, "/healthz", timeout=5.0)
            return
        except (OSError, ValueError) as exc:  # ConnectionError, TimeoutError; a bad address
            errors.append(str(exc))
    if args.controllers:
        named = "from --controllers"
    elif os.environ.get("ADAMPS_CONTROLLERS"):
        named = "from $ADAMPS_CONTROLLERS"
    elif cluster:
        named = f"cluster {cluster!r}'s file"
    else:
        named = "the default address: no cluster file"
    raise ValueError(
        f"no controller answered at {','.join(addrs)} ({named}): start a cluster with "
        "`adamps up --detach`, or name a running one with --cluster NAME or --controllers "
        f"({'; '.join(errors)})"
    )


def environment(args: argparse.Namespace, run: str) -> dict[str, str]:
    """The cluster's part of every replica's environment."""
    addrs, info = clusters.find(args.controllers, args.cluster)
    env = dict(os.environ)
    env.update(
        ADAMPS_CONTROLLERS=",".join(addrs), ADAMPS_RUN=run,
        WORLD_SIZE=str(args.nproc), LOCAL_WORLD_SIZE=str(args.nproc), GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1",
    )  # fmt: skip
    if info is not None:
        env["ADAMPS_CLUSTER"] = info["name"]
        # the token's path, not the token (replicas resolve it as every command does); a token
        # in the launcher's own environment ($ADAMPS_TOKEN) is inherited and comes first
        if info.get("token_file") and not os.environ.get("ADAMPS_TOKEN_FILE"):
            env["ADAMPS_TOKEN_FILE"] = str(info["token_file"])
    return env


class Stop(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def supervise(replicas: list[Replica], max_restarts: int, stop_timeout: float) -> int:
    """Restarts failed replicas, until all exited 0 or one failed past its restarts."""
    failed: Replica | None = None
    while failed is None and any(r.code is None for r in replicas):
        time.sleep(0.1)
        for r in replicas:
            rc = r.proc.poll() if r.proc is not None and r.code is None else None
            if rc is None:
                continue
            if rc == 0:
                r.code = 0
            elif r.restarts < max_restarts:
                r.restarts += 1
                print(f"adamps launch: replica {r.rank} exited with {rc}; restart {r.restarts} "
                      f"of {max_restarts}", file=sys.stderr, flush=True)  # fmt: skip
                r.start()
            else:
                r.code = rc
                failed = r
                break
    if failed is None:
        n = sum(r.restarts for r in replicas)
        print(f"adamps launch: all {len(replicas)} replicas finished ({n} restart"
              f"{'' if n == 1 else 's'})", flush=True)  # fmt: skip
        return 0
    stop_all(replicas, stop_timeout)
    n = failed.restarts
    print(f"adamps launch: replica {failed.rank} failed with exit code {failed.code} after {n} "
          f"restart{'' if n == 1 else 's'}; stopped the others", file=sys.stderr, flush=True)  # fmt: skip
    return int(failed.code or 1) if (failed.code or 0) > 0 else 128 - int(failed.code or 0)


def stop_all(replicas: list[Replica], timeout: float) -> None:
    for r in replicas:
        r.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for r in replicas:
        if r.proc is None:
            continue
        try:
            r.proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            r.signal(signal.SIGKILL)
            r.proc.wait()
        r.signal(signal.SIGKILL)  # what is left of its group


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    script = Path(args.script)
    try:
        if args.nproc < 1:
            raise ValueError(f"-n {args.nproc}: expected a number of replicas >= 1")
        if args.max_restarts < 0:
            raise ValueError(f"--max-restarts {args.max_restarts}: expected an integer >= 0")
        if not script.is_file():
            raise ValueError(f"{args.script}: no such file (expected a python script)")
        run = args.run or "".join(c if c.isalnum() or c in "_-" else "_" for c in script.stem)
        runs.check_name(run)
        env = environment(args, run)
        reachable(env["ADAMPS_CONTROLLERS"].split(","), args, env.get("ADAMPS_CLUSTER"))
    except ValueError as exc:  # also clusters.ClusterError, runs' name errors
        print(f"adamps launch: {exc}", file=sys.stderr)
        return 2
    replicas = []
    for rank in range(args.nproc):
        renv = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
        replicas.append(Replica(rank, [sys.executable, str(script), *args.args], renv))
    print(f"adamps launch: {args.nproc} replicas of {script} on {env['ADAMPS_CONTROLLERS']}, "
          f"run {run}", flush=True)  # fmt: skip

    def on_signal(signum: int, _frame: object) -> None:
        raise Stop(signum)

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for r in replicas:
            r.start()
        return supervise(replicas, args.max_restarts, args.stop_timeout)
    except Stop as exc:
        for s in old:
            signal.signal(s, signal.SIG_IGN)
        stop_all(replicas, args.stop_timeout)
        name = signal.Signals(exc.signum).name
        print(f"adamps launch: {name}: stopped every replica", file=sys.stderr, flush=True)
        return 128 + exc.signum
    finally:
        for s, h in old.items():
            signal.signal(s, h)
