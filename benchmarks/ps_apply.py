"""Parameter-server apply and wire throughput, each beside the limit it is measured against.

Limits (measured in this run, on this machine):
  - memory bandwidth: np.copyto of 256 MiB, expressed also as "copyto-equivalent updates/s"
    (bytes copied / 4: a float32 update w += d moves the same three streams as a copy that
    write-allocates: read d, read w, write w);
  - compute: scipy sgemm in place (beta=1) on the whole M x N weight, 1 BLAS thread, M*N updates/call;
  - network: raw TCP on loopback, blocking sendall/recv_into of 4 MiB messages into a preallocated
    buffer (a second process receives).

The PS figures: the real Store (owner threads, queues, batching, optim kernels) in this process for
dense SGD, dense Adagrad and activation/error pushes; a real `adamps ps` process over loopback HTTP
for 4 MB pushes and pulls (1 and 4 connections); the same server with TLS on both ports (a CA made by
the run) beside the plain one, for the cost of TLS. Peer authentication does not apply here (a
single server replicates nothing): benchmarks/replication.py measures it.

Run: python benchmarks/ps_apply.py   (about a minute; the last line is one JSON object)
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np
from scipy.linalg import blas
from threadpoolctl import threadpool_limits

from adamps.client import PSClient, StaticRouting
from adamps.client.dataplane import DataPlaneClient
from adamps.client.rpc import SyncRpc
from adamps.layout import Layout, TensorSpec
from adamps.security import tls, tls_certs
from adamps.server.main import tune_malloc
from adamps.server.store.initial import normalize_init
from adamps.server.store.shards import fc_parts
from adamps.server.store.store import Store
from adamps.server.updates import kernels
from adamps.server.updates.optim import Dense, Optimizer
from adamps.up.procs import Proc, adamps_argv, free_port

MiB = 1 << 20
BODY = 4 * MiB
TOKEN = "bench-token"
RESULTS: dict[str, float] = {}
MISSED: list[str] = []


def timed(fn: Callable[[], None], n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return time.perf_counter() - t0


def report(
    name: str, value: float, unit: str, limit: float | None = None, target: float | None = None
) -> None:
    RESULTS[f"{name}_{unit}"] = round(value, 4)
    line = f"  {name:<38} {value:10.3f} {unit}"
    if limit is not None:
        ratio = value / limit
        RESULTS[f"{name}_ratio"] = round(ratio, 3)
        line += f"   ratio to limit {ratio:5.2f}"
        if target is not None:
            ok = ratio >= target
            line += f"  (target >= {target}: {'met' if ok else 'MISSED'})"
            if not ok:
                MISSED.append(f"{name}: {ratio:.2f} < {target}")
    print(line, flush=True)


# -- in-process store -----------------------------------------------------------------------------


def wait_push(store: Store, parts: list) -> Future:
    fut: Future = Future()
    store.push(parts, lambda r, e: fut.set_exception(e) if e else fut.set_result(r))
    return fut


def interleaved(fns: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Median rate of each fn, sampled in alternation: the machine is shared and noisy, so a limit
    and the figure compared with it are measured side by side, round after round."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(fn())
    return {k: statistics.median(v) for k, v in samples.items()}


class DenseBench:
    """One push of dense deltas for a whole n_elems tensor (1 MB shards), waited for."""

    def __init__(self, kind: str, owner_threads: int, n_elems: int) -> None:
        self.store = Store(n_buckets=64, owner_threads=owner_threads)
        spec = TensorSpec("w", (n_elems,))
        init = normalize_init({"kind": "constant", "value": 1.0}, spec.shape)
        t = self.store.define(spec, Optimizer(kind, 0.01), init, None)
        delta = np.random.default_rng(0).standard_normal(n_elems).astype(np.float32) * 1e-3
        self.parts = [(t.shards[s.index], Dense(delta[s.start : s.stop])) for s in t.layout_shards]
        self.n = n_elems
        wait_push(self.store, self.parts).result()  # warm-up

    def sample(self) -> float:
        """Weight updates/s over two pushes."""
        dt = timed(lambda: wait_push(self.store, self.parts).result(), 2)
        return 2 * self.n / dt


class RawSaxpy:
    """The kernel alone: saxpy over 64 separate 1 MB shards, no queues, no threads."""

    def __init__(self, n_elems: int) -> None:
        shard = 262_144
        self.ws = [np.ones(shard, np.float32) for _ in range(n_elems // shard)]
        delta = np.random.default_rng(0).standard_normal(n_elems).astype(np.float32) * 1e-3
        self.ds = [delta[i * shard : (i + 1) * shard] for i in range(len(self.ws))]
        self.n = n_elems

    def sample(self) -> float:
        def once() -> None:
            for w, d in zip(self.ws, self.ds, strict=True):
                blas.saxpy(d, w, a=-0.01)

        return 2 * self.n / timed(once, 2)


class RawAdagrad:
    """The Adagrad kernel alone over 64 separate 1 MB shards and accumulators, no queues, no
    threads: the fused (numba) kernel, or the numpy reference (issue 27), in the same run."""

    def __init__(self, n_elems: int, fused: bool) -> None:
        shard = 262_144
        k = n_elems // shard
        self.ws = [np.ones(shard, np.float32) for _ in range(k)]
        self.accs = [np.zeros(shard, np.float32) for _ in range(k)]
        delta = np.random.default_rng(0).standard_normal(n_elems).astype(np.float32) * 1e-3
        self.gs = [delta[i * shard : (i + 1) * shard] for i in range(k)]
        self.tmp = np.empty(shard, np.float32)
        if fused:
            kernels.load()  # a process loads them on its first update, in a thread
        self.fn = kernels.adagrad if fused else kernels.adagrad_numpy
        self.n = n_elems

    def sample(self) -> float:
        def once() -> None:
            for w, acc, g in zip(self.ws, self.accs, self.gs, strict=True):
                self.fn(w, acc, g, 0.01, 1e-8, self.tmp)

        return 2 * self.n / timed(once, 2)


class FcBench:
    """push_fc of k activation/error vectors to an M x N tensor; M*N weight updates per push."""

    def __init__(self, k: int, m: int, n: int, calls: int) -> None:
        self.store = Store(n_buckets=64, owner_threads=1)
        spec = TensorSpec("fc", (m, n))
        self.t = self.store.define(
            spec, Optimizer("sgd", 1e-4), normalize_init(None, spec.shape), None
        )
        g = np.random.default_rng(1)
        self.a = g.standard_normal((k, n)).astype(np.float32)
        self.e = g.standard_normal((k, m)).astype(np.float32)
        self.sts = [self.t.shards[s.index] for s in self.t.layout_shards]
        self.calls, self.mn = calls, m * n
        wait_push(self.store, fc_parts(self.t, self.a, self.e, self.sts)).result()

    def one_at_a_time(self) -> float:
        t0 = time.perf_counter()
        for _ in range(self.calls):
            wait_push(self.store, fc_parts(self.t, self.a, self.e, self.sts)).result()
        return self.calls * self.mn / (time.perf_counter() - t0)

    def pipelined(self) -> float:
        """Many pushes in flight: the owner thread stacks a shard's queue into bigger sgemms."""
        t0 = time.perf_counter()
        futs = [
            wait_push(self.store, fc_parts(self.t, self.a, self.e, self.sts))
            for _ in range(self.calls)
        ]
        for f in futs:
            f.result()
        return self.calls * self.mn / (time.perf_counter() - t0)


class Copyto:
    def __init__(self) -> None:
        self.src = np.ones(64 * MiB, np.float32)  # 256 MiB
        self.dst = np.zeros_like(self.src)
        np.copyto(self.dst, self.src)

    def sample(self) -> float:
        """GB/s copied."""
        return self.src.nbytes / timed(lambda: np.copyto(self.dst, self.src), 1) / 1e9


class Sgemm:
    def __init__(self, k: int, m: int, n: int, calls: int) -> None:
        self.w = np.zeros((m, n), np.float32)
        g = np.random.default_rng(1)
        self.a = g.standard_normal((k, n)).astype(np.float32)
        self.e = g.standard_normal((k, m)).astype(np.float32)
        out = blas.sgemm(-1e-4, self.a.T, self.e.T, beta=1.0, c=self.w.T, trans_b=1, overwrite_c=1)
        assert np.shares_memory(out, self.w), "sgemm did not write in place"
        self.calls, self.mn = calls, m * n

    def sample(self) -> float:
        """M*N weight updates/s."""
        a, e, w = self.a, self.e, self.w

        def call() -> None:
            blas.sgemm(-1e-4, a.T, e.T, beta=1.0, c=w.T, trans_b=1, overwrite_c=1)

        return self.calls * self.mn / timed(call, self.calls)


# -- raw TCP --------------------------------------------------------------------------------------


def _tcp_sink(port_q: mp.Queue, msg: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(msg)
    view = memoryview(buf)
    while True:
        got = 0
        while got < msg:
            r = conn.recv_into(view[got:], msg - got)
            if r == 0:
                return
            got += r
        conn.sendall(b"ok      ")


class RawTcp:
    """4 MiB messages to a receiving process: blocking sendall / recv_into a preallocated buffer.

    stream(): back-to-back messages (the sink's 8-byte acks are read afterwards, never waited
    for in between); ping_pong(): one message, then wait for its ack (request/response, like HTTP).
    """

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        q: mp.Queue = ctx.Queue()
        self.proc = ctx.Process(target=_tcp_sink, args=(q, BODY), daemon=True)
        self.proc.start()
        self.sock = socket.create_connection(("127.0.0.1", q.get(timeout=30)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.payload = bytes(BODY)
        self.ack = bytearray(8 * 64)

    def _read_acks(self, n: int) -> None:
        want = 8 * n
        while want:
            want -= self.sock.recv_into(memoryview(self.ack)[: min(want, len(self.ack))])

    def stream(self, seconds: float = 0.6) -> float:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(8):
                self.sock.sendall(self.payload)
            self._read_acks(8)  # 64 bytes of acks fit the socket buffer: no stall in between
            n += 8
        return n * BODY / (time.perf_counter() - t0) / 1e9

    def ping_pong(self, seconds: float = 0.6) -> float:
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            self.sock.sendall(self.payload)
            self._read_acks(1)
            n += 1
        return n * BODY / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.sock.close()
        self.proc.join(5)
        if self.proc.is_alive():
            self.proc.terminate()


# -- a real PS process over HTTP ------------------------------------------------------------------


def _aiohttp_sink(port: int) -> None:
    """The HTTP framework's own ceiling: an aiohttp app that reads the body and discards it."""
    from aiohttp import web

    from adamps.wire import protocol

    tune_malloc()

    async def rpc(request: web.Request) -> web.Response:
        body = await request.read()
        reply = protocol.encode({"rid": None, "n": len(body)})
        return web.Response(body=reply, content_type="application/msgpack")

    app = web.Application(client_max_size=256 * MiB)
    app.router.add_post("/rpc", rpc)
    app.router.add_get("/healthz", lambda r: web.json_response({"ok": True}))
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def aes_gcm_rate(seconds: float = 0.3) -> float:
    """GB/s of AES-256-GCM over 4 MiB in this process (OpenSSL, through the cryptography
    package): the cipher TLS 1.3 negotiates here (TLS_AES_256_GCM_SHA384), the limit of one
    TLS stream's encryption on one core. A TLS byte is encrypted by the sender and decrypted by
    the receiver."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    aead, nonce, data = AESGCM(AESGCM.generate_key(bit_length=256)), b"\0" * 12, bytes(BODY)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        aead.encrypt(nonce, data, None)
        n += 1
    return n * BODY / (time.perf_counter() - t0) / 1e9


def wait_healthz(base: str, timeout: float = 30.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=1.0):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class DataPlaneClients:
    """`conns` data-plane connections (threads), each pushing or pulling 4 MB payloads."""

    def __init__(self, port: int, conns: int) -> None:
        self.clients = [DataPlaneClient("127.0.0.1", port, TOKEN) for _ in range(conns)]
        self.delta = np.full(BODY // 4, 1e-6, np.float32)
        self.outs = [np.empty(BODY // 4, np.float32) for _ in range(conns)]

    def rate(self, op: str, seconds: float = 0.8) -> float:
        counts = [0] * len(self.clients)
        stop = time.perf_counter() + seconds

        def call(i: int) -> int:
            if op == "push":
                self.clients[i].push_dense("p", self.delta)
            elif op == "push_pipelined":  # 4 in flight on the connection
                self.clients[i].push_many([("p", self.delta)] * 8, window=4)
                return 8
            else:
                self.clients[i].pull("p", out=self.outs[i])
            return 1

        def worker(i: int) -> None:
            while time.perf_counter() < stop:
                counts[i] += call(i)

        for i in range(len(self.clients)):
            call(i)
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(self.clients))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) * BODY / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        for c in self.clients:
            c.close()


class PSClients:
    """One adamps.client.ps.PSClient (the trainers' client: shards split by server, (client, seq)
    per push) over the data plane (shard frames) or HTTP, pushing or pulling tensor p (4 MB)."""

    def __init__(self, base: str, data_plane: bool) -> None:
        layout = Layout([TensorSpec("p", (BODY // 4,))], n_buckets=64)
        self.client = PSClient(StaticRouting([base], 64), layout, TOKEN, data_plane=data_plane)
        self.delta = np.full(BODY // 4, 1e-6, np.float32)
        self.out = {"p": np.empty(BODY // 4, np.float32)}

    def rate(self, op: str, seconds: float = 0.8) -> float:
        def call() -> None:
            if op == "push":
                self.client.push_dense("p", self.delta)
            else:
                self.client.pull(["p"], out=self.out)

        call()
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            call()
            n += 1
        return n * BODY / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.client.close()


class HttpClients:
    """`conns` keep-alive connections (threads), each pushing or pulling 4 MB bodies."""

    def __init__(self, base: str, conns: int) -> None:
        self.clients = [SyncRpc(base, TOKEN) for _ in range(conns)]
        self.delta = np.full(BODY // 4, 1e-6, np.float32)

    def _call(self, c: SyncRpc, op: str) -> None:
        if op == "push":
            c.call("push_dense", tensor="p", delta=self.delta)
        else:
            c.call("pull", tensors=["p"])

    def rate(self, op: str, seconds: float = 0.8) -> float:
        """GB/s of 4 MB bodies (push: request bodies; pull: reply bodies)."""
        counts = [0] * len(self.clients)
        stop = time.perf_counter() + seconds

        def worker(i: int) -> None:
            while time.perf_counter() < stop:
                self._call(self.clients[i], op)
                counts[i] += 1

        for c in self.clients:
            self._call(c, op)  # connected and warm
        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(self.clients))]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return sum(counts) * BODY / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        for c in self.clients:
            c.close()


def main() -> int:
    t_start = time.perf_counter()
    print(
        f"adamps benchmarks/ps_apply.py  ({os.cpu_count()} CPUs, Python {sys.version.split()[0]}, "
        f"numpy {np.__version__}); limits and figures sampled in alternation, medians"
    )
    # The client side of this process gets the same malloc thresholds as the PS (a lever for
    # multi-MB bodies; trainers should do the same).
    tune_malloc()
    with threadpool_limits(limits=1):
        print("\n[memory] limit: np.copyto of 256 MiB (1 thread);")
        print(
            "         PS: one push of dense deltas for a 64 MiB tensor (64 shards of 1 MB) through the Store"
        )
        n_elems = 16 * MiB  # beyond the caches
        cp = Copyto()
        benches = {
            "dense_sgd_1_owner": DenseBench("sgd", 1, n_elems),
            "dense_sgd_2_owners": DenseBench("sgd", 2, n_elems),
            "dense_adagrad_1_owner": DenseBench("adagrad", 1, n_elems),
            "dense_adagrad_2_owners": DenseBench("adagrad", 2, n_elems),
        }
        raw = RawSaxpy(n_elems)
        ada_np, ada_fused = RawAdagrad(n_elems, False), RawAdagrad(n_elems, True)
        fns: dict[str, Callable[[], float]] = {
            "copyto": cp.sample,
            "raw_saxpy": raw.sample,
            "raw_adagrad_numpy": ada_np.sample,
            "raw_adagrad_fused": ada_fused.sample,
        }
        fns.update({k: b.sample for k, b in benches.items()})
        med = interleaved(fns, 5)
        for b in benches.values():
            b.store.close()
        del cp, benches, raw, ada_np, ada_fused
        report("copyto", med["copyto"], "GB/s")
        eq = med["copyto"] / 4
        report("copyto_equivalent_updates", eq, "G/s")
        report("kernel_saxpy_no_store", med["raw_saxpy"] / 1e9, "G/s", eq)
        report("dense_sgd_1_owner", med["dense_sgd_1_owner"] / 1e9, "G/s", eq, 0.8)
        report("dense_sgd_2_owners", med["dense_sgd_2_owners"] / 1e9, "G/s", eq)
        report("dense_adagrad_1_owner", med["dense_adagrad_1_owner"] / 1e9, "G/s", eq)
        report("dense_adagrad_2_owners", med["dense_adagrad_2_owners"] / 1e9, "G/s", eq)
        # issue 27: the kernel alone, fused (the default) and its numpy reference (ADAMPS_KERNELS=numpy)
        report("kernel_adagrad_numpy_no_store", med["raw_adagrad_numpy"] / 1e9, "G/s", eq)
        report(
            "kernel_adagrad_fused_no_store",
            med["raw_adagrad_fused"] / 1e9,
            "G/s",
            med["raw_adagrad_numpy"] / 1e9,
        )

        m = n = 2048  # 16 shards of 128 rows
        for k in (16, 64):
            calls = 40 if k == 16 else 16
            print(f"\n[compute] limit: in-place sgemm, W {m}x{n} += e.T @ a with k={k}, 1 thread;")
            print(
                "          PS: push_fc through the Store (1 owner thread, 16 row blocks of 128 rows)"
            )
            lim, fc = Sgemm(k, m, n, calls), FcBench(k, m, n, calls)
            med = interleaved({"lim": lim.sample, "one": fc.one_at_a_time, "pipe": fc.pipelined}, 7)
            fc.store.close()
            report(f"sgemm_k{k}", med["lim"] / 1e9, "G/s")
            report(f"fc_k{k}_one_at_a_time", med["one"] / 1e9, "G/s", med["lim"] / 1e9, 0.8)
            report(f"fc_k{k}_pipelined", med["pipe"] / 1e9, "G/s", med["lim"] / 1e9)

    print("\n[network] limit: raw TCP on loopback, 4 MiB messages, blocking sendall/recv_into;")
    print("          PS: a real `adamps ps` process, 4 MB msgpack bodies over loopback HTTP;")
    print(
        "          aiohttp_discard: an aiohttp handler that only reads the body (the framework's ceiling)"
    )
    with tempfile.TemporaryDirectory() as tmp:
        port, data_port = free_port(), free_port()
        proc = Proc(
            adamps_argv("ps", "--port", str(port), "--data-port", str(data_port), "--data-dir", str(Path(tmp) / "lmdb"), "--flush-interval", "1", "--log-level", "WARNING"),
            Path(tmp) / "ps.log",
            env={"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"},
            name="ps",
        )  # fmt: skip
        # The same server with TLS on both ports (issue 28), the CA made here: its cost is the
        # ratio of its figures to the plain server's, measured in the same interleaved rounds.
        tls_files = tls_certs.write_ca_and_cert(tmp)
        tls_port, tls_data_port = free_port(), free_port()
        tls_proc = Proc(
            adamps_argv("ps", "--port", str(tls_port), "--data-port", str(tls_data_port), "--data-dir", str(Path(tmp) / "lmdb-tls"), "--flush-interval", "1", "--log-level", "WARNING"),
            Path(tmp) / "ps-tls.log",
            env={"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1", **tls_files.env()},
            name="ps-tls",
        )  # fmt: skip
        tcp = RawTcp()
        sink_port = free_port()
        sink = mp.get_context("spawn").Process(target=_aiohttp_sink, args=(sink_port,), daemon=True)
        sink.start()
        try:
            base = f"http://127.0.0.1:{port}"
            proc.wait_http(base + "/healthz", 30)
            with SyncRpc(base, TOKEN) as c:
                c.call("create", name="p", shape=[BODY // 4], optimizer={"kind": "sgd", "lr": 0.01})
            sink_base = f"http://127.0.0.1:{sink_port}"
            wait_healthz(sink_base)
            one, four = HttpClients(base, 1), HttpClients(base, 4)
            discard = HttpClients(sink_base, 1)
            dp1, dp4 = DataPlaneClients(data_port, 1), DataPlaneClients(data_port, 4)
            psc_dp, psc_http = PSClients(base, True), PSClients(base, False)
            # clients take this process's TLS setting when they connect: on for these only
            tls.install(tls.load(environ=tls_files.env()))
            tls_base = f"https://127.0.0.1:{tls_port}"
            tls_proc.wait_http(tls_base + "/healthz", 30)
            with SyncRpc(tls_base, TOKEN) as c:
                c.call("create", name="p", shape=[BODY // 4], optimizer={"kind": "sgd", "lr": 0.01})
            tls_one, tls_dp1 = HttpClients(tls_base, 1), DataPlaneClients(tls_data_port, 1)
            tls.install(tls.TlsConfig())
            med = interleaved(
                {
                    "tcp_stream": tcp.stream,
                    "tcp_ping_pong": tcp.ping_pong,
                    "discard1": lambda: discard.rate("push"),
                    "push1": lambda: one.rate("push"),
                    "push4": lambda: four.rate("push"),
                    "pull1": lambda: one.rate("pull"),
                    "pull4": lambda: four.rate("pull"),
                    "dp_push1": lambda: dp1.rate("push"),
                    "dp_push1_pipe": lambda: dp1.rate("push_pipelined"),
                    "dp_push4": lambda: dp4.rate("push"),
                    "dp_pull1": lambda: dp1.rate("pull"),
                    "dp_pull4": lambda: dp4.rate("pull"),
                    "psc_dp_push": lambda: psc_dp.rate("push"),
                    "psc_dp_pull": lambda: psc_dp.rate("pull"),
                    "psc_http_push": lambda: psc_http.rate("push"),
                    "psc_http_pull": lambda: psc_http.rate("pull"),
                    "aes_gcm": aes_gcm_rate,
                    "tls_push1": lambda: tls_one.rate("push"),
                    "tls_pull1": lambda: tls_one.rate("pull"),
                    "tls_dp_push1": lambda: tls_dp1.rate("push"),
                    "tls_dp_pull1": lambda: tls_dp1.rate("pull"),
                },
                4,
            )
            one.close()
            four.close()
            discard.close()
            dp1.close()
            dp4.close()
            psc_dp.close()
            psc_http.close()
            tls_one.close()
            tls_dp1.close()
        finally:
            sink.terminate()
            sink.join(5)
            tcp.close()
            proc.stop()
            tls_proc.stop()
    lim = med["tcp_stream"]
    report("tcp_stream", lim, "GB/s")
    report("tcp_ping_pong", med["tcp_ping_pong"], "GB/s")
    report("aiohttp_discard_4MB_1_conn", med["discard1"], "GB/s", lim)
    report("push_4MB_1_conn", med["push1"], "GB/s", lim, 0.6)
    report("push_4MB_4_conns", med["push4"], "GB/s", lim, 0.6)
    report("pull_4MB_1_conn", med["pull1"], "GB/s", lim)
    report("pull_4MB_4_conns", med["pull4"], "GB/s", lim)
    print("  binary data plane (raw float32 frames on the PS's data port, BufferedProtocol):")
    report("dataplane_push_4MB_1_conn", med["dp_push1"], "GB/s", lim, 0.6)
    report("dataplane_push_4MB_1_conn_pipelined", med["dp_push1_pipe"], "GB/s", lim, 0.6)
    report("dataplane_push_4MB_4_conns", med["dp_push4"], "GB/s", lim, 0.6)
    report("dataplane_pull_4MB_1_conn", med["dp_pull1"], "GB/s", lim)
    report("dataplane_pull_4MB_4_conns", med["dp_pull4"], "GB/s", lim)
    print("  PSClient, the trainers' client (4 shards of 1 MB, (client, seq); over the data plane")
    print("  frames of 1 MiB pipelined, issue 27 (goal >= 0.65); over HTTP one request per op):")
    report("psclient_dataplane_push_4MB", med["psc_dp_push"], "GB/s", lim, 0.65)
    report("psclient_dataplane_pull_4MB", med["psc_dp_pull"], "GB/s", lim)
    report("psclient_http_push_4MB", med["psc_http_push"], "GB/s", lim)
    report("psclient_http_pull_4MB", med["psc_http_pull"], "GB/s", lim)
    print(
        "  TLS on both ports (the same server, a CA made by this run; ratio to the plain figure):"
    )
    report("aes_256_gcm_4MiB_1_core", med["aes_gcm"], "GB/s", lim)
    for name, key, plain in (
        ("tls_push_4MB_1_conn", "tls_push1", "push1"),
        ("tls_pull_4MB_1_conn", "tls_pull1", "pull1"),
        ("tls_dataplane_push_4MB_1_conn", "tls_dp_push1", "dp_push1"),
        ("tls_dataplane_pull_4MB_1_conn", "tls_dp_pull1", "dp_pull1"),
    ):
        report(name, med[key], "GB/s", lim)
        cost = med[key] / med[plain]
        RESULTS[f"{name}_vs_plain"] = round(cost, 3)
        print(f"    {'':<36} {cost:5.2f} x the plain {plain}")

    RESULTS["wall_seconds"] = round(time.perf_counter() - t_start, 1)
    print()
    if MISSED:
        print(
            "targets MISSED: "
            + "; ".join(MISSED)
            + "  (docs/benchmarks-history.md: why, and what would close them)"
        )
    else:
        print("all targets met")
    print(json.dumps(RESULTS, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
