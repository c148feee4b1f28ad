"""adamps beside its peers, in one run: the same dense push/pull workload against each system.

The workload (issue 16): two client processes, each in a loop pushing a 64 MiB dense float32 delta
(w += d on the server) and pulling the 64 MiB tensor back, for `--seconds` each. The figure is
push+pull bytes per second summed over both clients (GB/s, 1e9 bytes), beside the raw loopback TCP
limit measured in the same run (benchmarks/ps_apply.RawTcp: one connection, 4 MiB messages,
blocking sendall/recv_into). Systems:

  - adamps, one standalone `adamps ps` (replication factor 1, no controllers) over HTTP
    (adamps.client.ps.PSClient, StaticRouting) and over its binary data plane
    (adamps.client.dataplane.DataPlaneClient, whole-tensor frames). The data plane takes pushes only
    on a server that does not replicate, hence a standalone server;
  - adamps clusters of 3 controllers + 3 parameter servers (benchmarks/replication.cluster) with
    replication factor 1 and 3, over HTTP (PSClient, ControllerRouting): the RF 3 / RF 1 ratio;
  - torch.distributed.rpc in the shape of PyTorch's parameter-server tutorial: a ParameterServer
    object on rank "ps", created by `rpc.remote`, trainers call `rref.rpc_sync().get_weights()` and
    `.apply(grad)` (w.add_ under a lock); TensorPipe backend, 1 intra-op thread per process;
  - a Ray actor parameter server (Ray's own example shape: `ps.apply_gradients.remote(grad)`,
    `ps.get_weights.remote()`), twice: one Ray node, where arrays move through the shared-memory
    object store (zero-copy reads), and two Ray nodes on this machine (the PS on one, the clients on
    the other), where every array crosses between object stores over TCP as it would between machines.

Every client process, and every server process we start, gets the same glibc malloc thresholds
(adamps.server.main.tune_malloc). torch and ray are optional (`pip install adamps[bench]`); a
missing one is reported and skipped.

    python benchmarks/peers.py [--seconds 10] [--skip torch,ray,...]

Human-readable lines, then as the last line one JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ps_apply import RawTcp  # noqa: E402  (the loopback TCP limit of ps_apply.py, not a copy)
from replication import N_BUCKETS  # noqa: E402
from replication import cluster as start_cluster  # noqa: E402

from adamps.client.dataplane import DataPlaneClient  # noqa: E402
from adamps.client.ps import ControllerRouting, PSClient, StaticRouting  # noqa: E402
from adamps.client.rpc import SyncRpc  # noqa: E402
from adamps.layout import Layout, TensorSpec  # noqa: E402
from adamps.server.main import tune_malloc  # noqa: E402
from adamps.up.procs import Proc, adamps_argv, free_port  # noqa: E402

TOKEN = "bench-token"
N_ELEMS = 16 << 20  # 64 MiB of float32
NBYTES = N_ELEMS * 4
CLIENTS = 2
#: every client pushes this delta: small enough that w stays finite and bounded for any run length
DELTA = 1e-7
RESULTS: dict[str, Any] = {}


# -- one client process ---------------------------------------------------------------------------


def _ops(kind: str, cfg: dict[str, Any], i: int) -> tuple[Callable[[], None], Callable[[], None]]:
    """(push, pull) of client `i` of system `kind`; each moves NBYTES."""
    delta = np.full(N_ELEMS, DELTA, np.float32)
    out = np.empty(N_ELEMS, np.float32)
    if kind in ("http", "cluster_dp"):
        routing = (
            ControllerRouting(cfg["controllers"])
            if "controllers" in cfg
            else StaticRouting(cfg["servers"], N_BUCKETS)
        )
        layout = Layout([TensorSpec("w", (N_ELEMS,))], n_buckets=N_BUCKETS)
        client = PSClient(routing, layout, TOKEN, data_plane=kind == "cluster_dp")
        return (
            lambda: client.push_dense("w", delta),
            lambda: client.pull(["w"], out={"w": out}) and None,
        )
    if kind == "dataplane":
        dp = DataPlaneClient("127.0.0.1", cfg["data_port"], TOKEN)
        return lambda: dp.push_dense("w", delta) and None, lambda: dp.pull("w", out=out) and None
    if kind == "torch":
        import torch
        import torch.distributed.rpc as rpc

        # rpc.shutdown's own use of a deprecated c10d API warns in every process: not ours to fix
        warnings.filterwarnings("ignore", category=UserWarning, module="torch")
        torch.set_num_threads(1)
        rpc.init_rpc(f"trainer{i}", rank=i + 1, world_size=CLIENTS + 1,
                     rpc_backend_options=_torch_options(cfg["port"]))  # fmt: skip
        # The tutorial's shape: the trainer asks the PS process for (a reference to) its object.
        ps_rref = rpc.remote("ps", _get_torch_ps, args=(N_ELEMS,))
        grad = torch.from_numpy(delta)
        cfg["_shutdown"] = rpc.shutdown
        return lambda: ps_rref.rpc_sync().apply(grad), lambda: ps_rref.rpc_sync().get_weights()
    raise ValueError(f"unknown client kind {kind!r}")


def client_main(kind: str, cfg: dict[str, Any], i: int, seconds: float, ready: Any, go: Any,
                results: Any) -> None:  # fmt: skip
    """Warm up, wait for every client, then push+pull in a loop for `seconds`."""
    tune_malloc()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    try:
        push, pull = _ops(kind, cfg, i)
        push()
        pull()
        ready.put(i)
        go.wait(120)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            push()
            pull()
            n += 1
        results.put((i, n, time.perf_counter() - t0, None))
        if "_shutdown" in cfg:
            cfg["_shutdown"]()
    except Exception as exc:  # reported by the parent, which then skips this system
        ready.put(i)
        results.put((i, 0, 1.0, f"{type(exc).__name__}: {exc}"))


def run_clients(kind: str, cfg: dict[str, Any], seconds: float) -> float:
    """GB/s of push+pull bytes of CLIENTS client processes, started together."""
    ctx = mp.get_context("spawn")
    ready, results, go = ctx.Queue(), ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=client_main, args=(kind, cfg, i, seconds, ready, go, results),
                         daemon=True) for i in range(CLIENTS)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=300)
        go.set()
        got = [results.get(timeout=seconds + 300) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.terminate()
    errors = [e for *_, e in got if e]
    if errors:
        raise RuntimeError("; ".join(errors))
    return sum(n * 2 * NBYTES / dt for _, n, dt, _ in got) / 1e9


# -- adamps -----------------------------------------------------------------------------------------


def adamps_standalone(root: Path, seconds: float) -> dict[str, float]:
    """One `adamps ps` without controllers (RF 1): HTTP and the data plane against the same server."""
    port, data_port = free_port(), free_port()
    proc = Proc(
        adamps_argv("ps", "--port", str(port), "--data-port", str(data_port), "--n-buckets", str(N_BUCKETS),
                    "--data-dir", str(root / "lmdb"), "--log-level", "WARNING"),
        root / "ps.log", env={"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"}, name="ps",
    )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        proc.wait_http(base + "/healthz", 60)
        with SyncRpc(base, TOKEN) as c:
            c.call("create", name="w", shape=[N_ELEMS], optimizer={"kind": "sgd", "lr": -1.0})
        return {
            "http": run_clients("http", {"servers": [base]}, seconds),
            "dataplane": run_clients("dataplane", {"data_port": data_port}, seconds),
        }
    finally:
        proc.stop()


def adamps_cluster(root: Path, rf: int, seconds: float) -> dict[str, float]:
    """3 controllers + 3 parameter servers with replication factor `rf`: clients over HTTP,
    then over the servers' data planes (PSClient's default)."""
    c = start_cluster(str(root / f"rf{rf}"), rf, 262_144)  # 1 MB shards, the default
    try:
        layout = Layout([TensorSpec("w", (N_ELEMS,))], n_buckets=N_BUCKETS)
        with PSClient(ControllerRouting(c.controllers), layout, TOKEN) as setup:
            setup.create(layout.tensors["w"], init={"kind": "zeros"},
                         optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip
        return {
            "http": run_clients("http", {"controllers": c.controllers}, seconds),
            "dataplane": run_clients("cluster_dp", {"controllers": c.controllers}, seconds),
        }
    finally:
        c.stop()


# -- torch.distributed.rpc ----------------------------------------------------------------------------


def _torch_options(port: int) -> Any:
    import torch.distributed.rpc as rpc

    return rpc.TensorPipeRpcBackendOptions(
        num_worker_threads=8, rpc_timeout=300, init_method=f"tcp://127.0.0.1:{port}"
    )


class TorchParameterServer:
    """The tutorial's ParameterServer: the weights live here; trainers reach it through an RRef."""

    def __init__(self, n: int) -> None:
        import torch

        self.w = torch.zeros(n, dtype=torch.float32)
        self.lock = threading.Lock()

    def get_weights(self) -> Any:
        return self.w

    def apply(self, grad: Any) -> None:
        with self.lock:
            self.w.add_(grad)


_torch_ps: list[TorchParameterServer] = []
_torch_ps_lock = threading.Lock()


def _get_torch_ps(n: int) -> TorchParameterServer:
    """Runs on the PS: one ParameterServer for every trainer (the tutorial's get_parameter_server)."""
    with _torch_ps_lock:
        if not _torch_ps:
            _torch_ps.append(TorchParameterServer(n))
        return _torch_ps[0]


def _torch_ps_main(port: int) -> None:
    import torch
    import torch.distributed.rpc as rpc

    tune_malloc()
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")
    torch.set_num_threads(1)
    rpc.init_rpc("ps", rank=0, world_size=CLIENTS + 1, rpc_backend_options=_torch_options(port))
    rpc.shutdown()  # waits until every trainer has shut down


def torch_rpc(seconds: float) -> float:
    port = free_port()
    ps = mp.get_context("spawn").Process(target=_torch_ps_main, args=(port,), daemon=True)
    ps.start()
    try:
        return run_clients("torch", {"port": port}, seconds)
    finally:
        ps.join(60)
        if ps.is_alive():
            ps.terminate()


# -- Ray ------------------------------------------------------------------------------------------


def ray_ps(seconds: float, two_nodes: bool) -> float:
    """A Ray actor PS and CLIENTS client actors; two_nodes: PS and clients on different raylets."""
    import ray
    from ray.cluster_utils import Cluster

    store = 2 << 30
    cluster = None
    if two_nodes:
        cluster = Cluster(initialize_head=True, head_node_args={
            "num_cpus": 2, "resources": {"ps_node": 1}, "object_store_memory": store})  # fmt: skip
        cluster.add_node(num_cpus=2, resources={"client_node": CLIENTS}, object_store_memory=store)
        ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
        ps_res, cl_res = {"ps_node": 1}, {"client_node": 1}
    else:
        ray.init(num_cpus=4, object_store_memory=store, include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)  # fmt: skip
        ps_res = cl_res = {}
    try:

        @ray.remote(num_cpus=0, resources=ps_res)
        class ParameterServer:
            def __init__(self, n: int) -> None:
                tune_malloc()
                self.w = np.zeros(n, np.float32)

            def apply_gradients(self, grad: np.ndarray) -> None:
                self.w += grad  # grad: a read-only view of the object store's copy

            def get_weights(self) -> np.ndarray:
                return self.w  # serialized into the object store on return

        @ray.remote(num_cpus=0, resources=cl_res)
        class Client:
            def __init__(self, ps: Any, n: int) -> None:
                tune_malloc()
                self.ps, self.grad = ps, np.full(n, DELTA, np.float32)

            def step(self) -> None:
                ray.get(self.ps.apply_gradients.remote(self.grad))
                ray.get(self.ps.get_weights.remote())  # zero-copy view where the store is local

            def run(self, start_at: float, seconds: float) -> tuple[int, float]:
                self.step()
                time.sleep(max(0.0, start_at - time.time()))
                n, t0 = 0, time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    self.step()
                    n += 1
                return n, time.perf_counter() - t0

        ps = ParameterServer.remote(N_ELEMS)
        clients = [Client.remote(ps, N_ELEMS) for _ in range(CLIENTS)]
        ray.get(ps.get_weights.remote())
        start_at = time.time() + 20.0  # every client is warm and waiting by then
        got = ray.get([c.run.remote(start_at, seconds) for c in clients], timeout=seconds + 300)
        return sum(n * 2 * NBYTES / dt for n, dt in got) / 1e9
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


# -- main -----------------------------------------------------------------------------------------


def optional(module: str) -> str | None:
    """The version of an optional peer, or None when it is not installed."""
    import importlib

    try:
        return str(importlib.import_module(module).__version__)
    except ImportError:
        return None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per system")
    p.add_argument("--skip", default="", help="comma-separated systems to skip: "
                   "standalone,rf1,rf3,torch,ray,ray2")  # fmt: skip
    args = p.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    tune_malloc()
    t_start = time.perf_counter()
    print(f"adamps benchmarks/peers.py ({os.cpu_count()} CPUs, Python {sys.version.split()[0]}): "
          f"{CLIENTS} client processes, each pushing a {NBYTES >> 20} MiB float32 delta and pulling "
          f"{NBYTES >> 20} MiB in a loop for {args.seconds:.0f} s; GB/s = push+pull bytes of both "
          "clients / s (1e9 B)", flush=True)  # fmt: skip
    tcp = RawTcp()
    tcp_samples: list[float] = []

    def limit() -> None:  # the limit, sampled before each system: the machine is shared
        tcp_samples.append(tcp.stream())

    figures: dict[str, float] = {}

    def record(key: str, label: str, fn: Callable[[], float | dict[str, float]]) -> None:
        limit()
        try:
            got = fn()
        except Exception as exc:
            print(f"  {label}: FAILED ({type(exc).__name__}: {str(exc)[:300]})", flush=True)
            RESULTS[f"{key}_error"] = str(exc)[:300]
            return
        for k, v in got.items() if isinstance(got, dict) else [("", got)]:
            name = f"{key}_{k}" if k else key
            figures[name] = v
            RESULTS[f"{name}_GB_per_s"] = round(v, 3)
            print(f"  {name:<28} {v:7.3f} GB/s", flush=True)

    with tempfile.TemporaryDirectory(prefix="adamps-peers-") as tmp:
        root = Path(tmp)
        if "standalone" not in skip:
            record("adamps_standalone_rf1", "adamps standalone RF 1",
                   lambda: adamps_standalone(root / "standalone", args.seconds))  # fmt: skip
        if "rf1" not in skip:
            record("adamps_cluster_rf1", "adamps cluster RF 1",
                   lambda: adamps_cluster(root, 1, args.seconds))  # fmt: skip
        if "rf3" not in skip:
            record("adamps_cluster_rf3", "adamps cluster RF 3",
                   lambda: adamps_cluster(root, 3, args.seconds))  # fmt: skip
    torch_v, ray_v = optional("torch"), optional("ray")
    RESULTS["torch_version"], RESULTS["ray_version"] = torch_v, ray_v
    if "torch" in skip:
        pass
    elif torch_v is None:
        print("  torch_rpc: SKIPPED, torch is not installed (pip install 'adamps[bench]')")
    else:
        record("torch_rpc", "torch.distributed.rpc", lambda: torch_rpc(args.seconds))
    if ray_v is None and not {"ray", "ray2"} <= skip:
        print("  ray: SKIPPED, ray is not installed (pip install 'adamps[bench]')")
    elif ray_v is not None:
        if "ray" not in skip:
            record("ray_1_node_shm", "Ray, one node", lambda: ray_ps(args.seconds, False))
        if "ray2" not in skip:
            record("ray_2_nodes_tcp", "Ray, two nodes", lambda: ray_ps(args.seconds, True))
    limit()
    tcp.close()
    lim = statistics.median(tcp_samples)
    RESULTS["tcp_loopback_GB_per_s"] = round(lim, 3)
    RESULTS["tcp_loopback_samples_GB_per_s"] = [round(x, 2) for x in tcp_samples]
    print(f"  {'tcp_loopback (limit)':<28} {lim:7.3f} GB/s  (one connection, 4 MiB messages, "
          f"median of {len(tcp_samples)} samples taken between the systems: "
          f"{', '.join(f'{x:.2f}' for x in tcp_samples)})")  # fmt: skip

    print("ratios:")

    def ratio(name: str, num: str, den: str, goal: float | None = None) -> None:
        if num not in figures or den not in figures:
            print(f"  {name}: not measured ({num if num not in figures else den} missing)")
            return
        r = figures[num] / figures[den]
        RESULTS[name] = round(r, 3)
        verdict = f"  (goal >= {goal}: {'met' if r >= goal else 'MISSED'})" if goal else ""
        print(f"  {name:<44} {r:6.2f}{verdict}")

    measured = [k for k in ("adamps_standalone_rf1_dataplane", "adamps_standalone_rf1_http",
                            "adamps_cluster_rf1_http", "adamps_cluster_rf1_dataplane")
                if k in figures]  # fmt: skip
    best = max(measured, key=lambda k: figures[k]) if measured else "adamps_rf1_best"
    RESULTS["adamps_rf1_best_path"] = best if measured else None
    ratio("adamps_rf1_best_over_torch_rpc", best, "torch_rpc", 1.5)
    ratio("adamps_rf1_dataplane_over_torch_rpc", "adamps_standalone_rf1_dataplane", "torch_rpc")
    ratio("adamps_cluster_rf1_http_over_torch_rpc", "adamps_cluster_rf1_http", "torch_rpc")
    ratio(
        "adamps_cluster_rf1_dataplane_over_torch_rpc", "adamps_cluster_rf1_dataplane", "torch_rpc"
    )
    ratio("adamps_rf3_over_rf1", "adamps_cluster_rf3_http", "adamps_cluster_rf1_http", 0.5)
    ratio("adamps_rf3_over_rf1_dataplane", "adamps_cluster_rf3_dataplane",
          "adamps_cluster_rf1_dataplane", 0.5)  # fmt: skip
    ratio("adamps_cluster_rf3_dataplane_over_http", "adamps_cluster_rf3_dataplane",
          "adamps_cluster_rf3_http")  # fmt: skip
    ratio("adamps_rf1_best_over_ray_1_node", best, "ray_1_node_shm")
    ratio("adamps_rf1_best_over_ray_2_nodes", best, "ray_2_nodes_tcp")
    ratio("ray_2_nodes_over_ray_1_node", "ray_2_nodes_tcp", "ray_1_node_shm")
    figures["tcp"] = lim
    for k in [k for k in figures if k != "tcp"]:
        ratio(f"{k}_over_tcp", k, "tcp")
    if measured:
        print(f"  (best adamps RF 1 path: {best})")
    if "ray_1_node_shm" in figures:
        print("# Ray on one machine: arguments and results above 100 KiB go through the shared-memory "
              "object store; a worker reads them as zero-copy views (one memcpy per 64 MiB: the writer's "
              "put), no socket. Across machines every such object is also pulled between object stores "
              "over TCP; 'ray_2_nodes_tcp' measures that on loopback (two raylets, the PS on one, the "
              "clients on the other): ray_2_nodes_over_ray_1_node is what the shared memory buys on one "
              "machine, and what leaving it costs.")  # fmt: skip
    RESULTS["clients"] = CLIENTS
    RESULTS["MiB_per_op"] = NBYTES >> 20
    RESULTS["seconds_per_system"] = args.seconds
    RESULTS["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(RESULTS, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
