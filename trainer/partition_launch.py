"""`adamps train --partitions K` (without --partition): one replica as K child processes on this
machine, supervised as one.

Each child is `adamps train ... --partition k --partition-addrs ...` with free loopback ports
(shared memory between them). When one partition exits before the replica is done, or dies,
the others are stopped (their process groups killed: no Hogwild worker survives), and the
replica starts again, up to ``partition_restarts`` times: from the parameter servers'
current parameters, skipping the epochs already complete, while the other replicas go on.
Partitions on several machines are started one per machine with --partition and
--partition-addrs (compose, Kubernetes); there the orchestrator restarts them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from typing import Any

from adamps.up.procs import PARENT_ENV, adamps_argv, free_port
from trainer.config import TrainConfig

log = logging.getLogger(__name__)

#: not passed on: the launcher sets them per child (the token goes through the environment)
_PER_CHILD = {"token", "partition", "partition_addrs", "metrics_port", "config"}


def child_flags(cfg: TrainConfig) -> list[str]:
    """The configuration as `adamps train` flags, the per-partition fields left out."""
    out: list[str] = []
    for f in dataclasses.fields(cfg):
        if f.name in _PER_CHILD:
            continue
        value = getattr(cfg, f.name)
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + f.name.replace("_", "-"))
        elif isinstance(value, list):
            if value:
                out += [flag, ",".join(str(v) for v in value)]
        else:
            out += [flag, str(value)]
    return out


def free_port_block(n: int, host: str = "127.0.0.1", tries: int = 200) -> int:
    """A port p with p .. p+n-1 all free now (control link + one per worker), below the
    kernel's ephemeral range like adamps.up.procs.free_port: ports the kernel hands out are also
    the source ports of outgoing connections, which could take one before a partition binds."""
    for _ in range(tries):
        base = free_port(host)
        if base + n >= 65535:
            continue
        socks = []
        try:
            for i in range(n):
                t = socket.socket()
                socks.append(t)
                t.bind((host, base + i))
            return base
        except OSError:
            continue
        finally:
            for t in socks:
                t.close()
    raise OSError(f"no block of {n} free ports on {host}")


class _Child:
    def __init__(self, k: int, argv: list[str], env: dict[str, str]) -> None:
        self.k = k
        self.popen = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own group: stopping it reaches its Hogwild workers
        )
        self.last_line = ""
        self._reader = threading.Thread(target=self._forward, daemon=True)
        self._reader.start()

    def _forward(self) -> None:
        assert self.popen.stdout is not None
        for raw in self.popen.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if line:
                self.last_line = line
                print(f"[partition {self.k}] {line}", flush=True)

    def stop(self, timeout: float = 10.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.popen.wait()
        self._reader.join(2)


def _start(cfg: TrainConfig) -> list[_Child]:
    if cfg.partition_addrs:
        addrs = list(cfg.partition_addrs)
    else:
        addrs = [f"127.0.0.1:{free_port_block(cfg.workers + 1)}" for _ in range(cfg.partitions)]
    env = {**os.environ, "ADAMPS_TOKEN": cfg.token, PARENT_ENV: str(os.getpid())}
    flags = child_flags(cfg)
    children = []
    for k in range(cfg.partitions):
        # the leader serves on the port asked for (the replica's figures); the followers on
        # any free port, which they tell the leader (its /status lists them)
        port = cfg.metrics_port if k == 0 or cfg.metrics_port < 0 else 0
        argv = adamps_argv(
            "train",
            *flags,
            "--partition", str(k),
            "--partition-addrs", ",".join(addrs),
            "--metrics-port", str(port),
        )  # fmt: skip
        children.append(_Child(k, argv, env))
    log.info("replica %d: %d partitions at %s (pids %s)", cfg.replica, cfg.partitions,
             ",".join(addrs), [c.popen.pid for c in children])  # fmt: skip
    return children


def supervise(children: list[_Child], stopping: threading.Event) -> int | None:
    """0 when every partition finished, None when one failed (the others are then stopped),
    or -1 when asked to stop."""
    try:
        while True:
            codes = [c.popen.poll() for c in children]
            if all(code == 0 for code in codes):
                return 0
            failed = [(c.k, code) for c, code in zip(children, codes, strict=True) if code]
            if failed:
                log.warning(
                    "partition %d exited with %d: stopping the replica's others", *failed[0]
                )
                return None
            if stopping.wait(0.2):
                return -1
    finally:
        for c in children:
            c.stop()


def launch(cfg: TrainConfig) -> int:
    stopping = threading.Event()
    received: list[int] = []

    def on_signal(signum: int, _frame: Any) -> None:
        received.append(signum)
        stopping.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    attempt = 0
    while True:
        children = _start(cfg)
        outcome = supervise(children, stopping)
        if outcome == -1:
            return 128 + received[0]
        if outcome == 0:
            summaries = {}
            for c in children:
                try:
                    summaries[str(c.k)] = json.loads(c.last_line)
                except ValueError:
                    summaries[str(c.k)] = None
            lead = dict(summaries.get("0") or {})
            lead["partitions"] = {
                k: {
                    key: (v or {}).get(key) for key in ("images_per_s", "bytes_pushed", "partition")
                }
                for k, v in summaries.items()
            }
            lead["restarts"] = attempt
            # the replica pushed what all its partitions pushed (each its own slices)
            for key in ("bytes_pushed", "pushes"):
                lead[key] = sum(int((v or {}).get(key) or 0) for v in summaries.values())
            print(json.dumps(lead), flush=True)
            return 0
        attempt += 1
        if attempt > cfg.partition_restarts:
            log.error("replica %d failed %d times: giving up", cfg.replica, attempt)
            return 1
        log.warning("restarting replica %d from the servers' parameters (restart %d of %d)",
                    cfg.replica, attempt, cfg.partition_restarts)  # fmt: skip
        time.sleep(0.5)
