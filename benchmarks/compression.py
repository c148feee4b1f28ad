"""Strom's threshold-quantized pushes with error feedback (Interspeech 2015, 2.4-2.6 and Table 3),
measured on this machine in one run:

1. **Speed**: encode (threshold, quantize, take tau out of the residual, pack) and decode + apply
   (words -> indices and signs -> the server's in-place sparse SGD step), in elements of the
   tensor per second, as a ratio to ``np.copyto`` elements per second on the same array size in
   the same run (the memory-bandwidth limit). Goal: encode >= 0.25 of np.copyto.
2. **Real gradients, closed loop**: adam-mnist trained in one process the way one adamps replica
   trains (batch 8, local SGD steps at ``--local-lr``, a push of the summed gradients every
   ``n_push`` = 4 minibatches applied by the server's own optimizer code, server-side Adagrad as
   in ``adamps train``, a fetch of the server's weights every ``n_fetch`` = 8 minibatches, plus
   the unsent residual, as ``adamps train`` installs it), with
   the push compressed by Strom's rule at each threshold (a fixed tau, or an adaptive tau sending
   a fraction of the elements), and by the PyTorch peers on the same loop when torch is installed:
   ``fp16_compress_hook`` and ``powerSGD_hook`` (run through a one-process gloo
   DistributedDataParallel, so the hooks are torch's own, error feedback included). For each:
   compression ratio (dense gradient bytes / bytes sent: Strom's definition), with words and with
   Golomb-Rice coding, bits per sent update, held-out accuracy after the same epochs, same seed.
3. **Table 3 on the real system**: 1 parameter server, 1 data server (built-in data, no
   augmentation) and ``--replicas`` ``adamps train`` processes, uncompressed and ``--compress``
   at each adaptive fraction, same epochs and seeds: tau, bytes pushed per image, compression
   ratio, bytes per image against uncompressed adamps (which already sends fully connected layers
   as activation/error vectors), images/s, held-out accuracy. Goal: >= 100x fewer bytes per image
   at a held-out accuracy within 0.3 percentage points.

    python benchmarks/compression.py                      # about 3 minutes on 2 cores
    python benchmarks/compression.py --epochs 10 --repeats 3 --speed-elems 67108864   # bigger
    python benchmarks/compression.py --skip-cluster       # parts 1-2 only

The last line is one JSON object of the figures (units in the names).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy: one BLAS thread, as trainers

import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adamps.compression import codec  # noqa: E402
from adamps.compression.error_feedback import Encoded, TensorCompressor  # noqa: E402
from adamps.layout import Layout, TensorSpec  # noqa: E402
from adamps.server.updates import optim  # noqa: E402
from adamps.server.updates.optim import Dense, Optimizer, Scratch, Signs  # noqa: E402
from adamps.up.procs import Proc, adamps_argv, free_port  # noqa: E402
from trainer.local import builtin_data  # noqa: E402
from trainer.model import Model, resolve_spec  # noqa: E402


def best_of(fn: Callable[[], Any], reps: int, setup: Callable[[], Any] | None = None) -> float:
    """Median seconds of fn over reps (setup, untimed, before each)."""
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# -- 1. speed --------------------------------------------------------------------------------------


def speed(n: int, fraction: float, reps: int) -> dict[str, float]:
    """Elements per second of each step, the steps interleaved rep by rep with np.copyto (the
    machine is shared: interleaving keeps the ratios fair when the load changes)."""
    rng = np.random.default_rng(0)
    base = rng.standard_normal(n).astype(np.float32)
    r = np.empty_like(base)
    dst = np.empty_like(base)
    mag = np.empty(min(n, codec.CHUNK), np.float32)
    tau = codec.adaptive_tau(base, fraction)
    idx, neg = codec.quantize(base.copy(), tau)
    words = codec.pack_words(idx, neg)
    data, k = codec.rice_encode(idx, neg, size=n)
    sent = int(words.size)
    w = np.zeros(n, np.float32)
    sgd = Optimizer("sgd", 0.01)

    def enc_words() -> None:
        i, g = codec.quantize(r, tau, mag)
        codec.pack_words(i, g)

    def enc_rice() -> None:
        i, g = codec.quantize(r, tau, mag)
        codec.rice_encode(i, g, size=n)

    def enc_adaptive() -> None:
        t = codec.adaptive_tau(r, fraction)
        i, g = codec.quantize(r, t, mag)
        codec.pack_words(i, g)

    def dec_words_apply() -> None:
        optim.sparse_step(sgd, w, None, Signs(words, tau))

    def dec_rice_apply() -> None:
        i, g = codec.rice_decode(data, sent, k, n)
        optim.sparse_step(sgd, w, None, Signs(codec.pack_words(i, g), tau))

    steps: dict[str, tuple[Callable[[], Any], bool]] = {
        "copyto": (lambda: np.copyto(dst, base), False),
        "encode_words": (enc_words, True),
        "encode_rice": (enc_rice, True),
        "encode_adaptive": (enc_adaptive, True),
        "decode_apply_words": (dec_words_apply, False),
        "decode_apply_rice": (dec_rice_apply, False),
    }
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, (fn, needs_reset) in steps.items():
            if needs_reset:
                np.copyto(r, base)  # untimed: a fresh residual for every encode
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    eps = {name: n / statistics.median(ts) for name, ts in times.items()}
    out: dict[str, float] = {"elements": n, "sent": sent}
    out["copyto_elements_per_s"] = eps["copyto"]
    for name in steps:
        if name != "copyto":
            out[f"{name}_elements_per_s"] = eps[name]
            out[f"{name}_ratio_to_copyto"] = eps[name] / eps["copyto"]
    return out


# -- 2. closed-loop training on real gradients --------------------------------------------------


class Method:
    """How a push travels: identity (uncompressed), Strom, or a torch hook."""

    name = "none"

    def push(self, grads: dict[str, np.ndarray]) -> tuple[list[tuple[str, Any]], int, int, int]:
        """(updates per tensor for the server, bytes sent (words or as-is), bytes with Rice,
        elements sent)."""
        ups = [(n, Dense(g)) for n, g in grads.items()]
        nbytes = sum(g.nbytes for g in grads.values())
        return ups, nbytes, nbytes, sum(g.size for g in grads.values())


class Strom(Method):
    def __init__(self, layout: Layout, tau: float | None, fraction: float) -> None:
        self.name = f"strom tau={tau:g}" if tau is not None else f"strom fraction={fraction:g}"
        self.layout = layout
        self.tcs = {
            n: TensorCompressor(n, layout.shards_of[n], tau=tau, fraction=fraction, coding="words")
            for n in layout.tensors
        }
        self.taus: list[float] = []

    def push(self, grads: dict[str, np.ndarray]) -> tuple[list[tuple[str, Any]], int, int, int]:
        ups: list[tuple[str, Any]] = []
        words_b = rice_b = sent = 0
        for name, g in grads.items():
            res = self.tcs[name].offer(g)
            if isinstance(res, Encoded):
                for sid, d in res.shards.items():
                    s = self.layout.shards[sid]
                    ups.append((name, (s, Signs(d["words"], d["tau"]))))
                    idx = (d["words"] >> np.uint32(1)).astype(np.int64)
                    rice_b += codec.rice_size(idx, codec.rice_parameter(idx.size, s.size))
                words_b += res.nbytes
                sent += res.sent
                if res.shards and name.endswith(".w"):
                    self.taus.append(res.tau)
            else:  # dense fallback (a tiny tensor): exact
                ups.append((name, Dense(res)))
                words_b += res.nbytes
                rice_b += res.nbytes
                sent += res.size
        return ups, words_b, rice_b, sent


class TorchHook(Method):
    """A DDP communication hook of PyTorch applied to our gradients: a one-process gloo group,
    a module whose parameters have our tensors' shapes and whose loss is sum(p * g), so the
    gradient handed to the hook is exactly ours; the hook's output (p.grad) is what the server
    gets. Bytes: what the hook would all-reduce (fp16: 2 per element; PowerSGD: P and Q of rank
    r for the matrices its min_compression_rate rule compresses, the rest as float32)."""

    group_ready = False

    def __init__(self, shapes: list[tuple[str, tuple[int, ...]]], kind: str, rank: int = 1) -> None:
        import torch
        import torch.distributed as dist
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
        from torch.nn.parallel import DistributedDataParallel as DDP

        if not TorchHook.group_ready:
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
            TorchHook.group_ready = True
        self.torch = torch
        self.names = [n for n, _ in shapes]

        class Holder(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ps = torch.nn.ParameterList(
                    [torch.nn.Parameter(torch.zeros(s)) for _, s in shapes]
                )

            def forward(self, gs: list[Any]) -> Any:
                return sum((p * g).sum() for p, g in zip(self.ps, gs, strict=True))

        self.module = Holder()
        self.ddp = DDP(self.module, bucket_cap_mb=64)
        self.nbytes = 0
        if kind == "fp16":
            self.name = "torch fp16_compress_hook"
            self.ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
            self.nbytes = sum(2 * math.prod(s) for _, s in shapes)
        else:
            self.name = f"torch powerSGD_hook rank {rank}"
            state = psgd.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=rank,
                start_powerSGD_iter=2,
                min_compression_rate=2,
                use_error_feedback=True,
                warm_start=True,
            )
            self.ddp.register_comm_hook(state, psgd.powerSGD_hook)
            for _, s in shapes:
                rows, cols = s[0], math.prod(s[1:]) if len(s) > 1 else 1
                if len(s) > 1 and rows * cols >= 2 * (rows + cols) * rank:
                    self.nbytes += 4 * (rows + cols) * rank
                else:
                    self.nbytes += 4 * rows * cols

    def push(self, grads: dict[str, np.ndarray]) -> tuple[list[tuple[str, Any]], int, int, int]:
        torch = self.torch
        for p in self.module.ps:
            p.grad = None
        out = self.ddp([torch.from_numpy(grads[n]) for n in self.names])
        out.backward()
        ups = [
            (n, Dense(p.grad.numpy().astype(np.float32, copy=True)))
            for n, p in zip(self.names, self.module.ps, strict=True)
        ]
        return ups, self.nbytes, self.nbytes, sum(g.size for g in grads.values())


def simulate(method: Method, data: tuple, args: argparse.Namespace) -> dict[str, Any]:
    """One replica's Downpour loop in one process (see the module doc), pushes through `method`."""
    train_x, train_y, test_x, test_y = data
    spec = resolve_spec("adam-mnist")
    local = Model(spec)
    local.init_params(args.seed)
    server = local.params.copy()
    acc = np.full_like(server, args.adagrad_initial)
    lr = args.lr * (args.compress_lr_scale if isinstance(method, Strom) else 1.0)
    # the DistBelief Adagrad this simulation was measured with (accumulator shaped like `server`)
    opt = Optimizer("adagrad_legacy", lr, {"initial_accumulator": args.adagrad_initial})
    sl = local.slices()
    shapes = dict(local.tensors())
    scratch = Scratch(262_144)
    sum_grad = np.zeros_like(server)
    xs = local.prepare(train_x)
    pushes = words_b = rice_b = sent = 0
    t0 = time.perf_counter()
    from trainer.local import epoch_batches

    step = 0
    for epoch in range(1, args.epochs + 1):
        for idx in epoch_batches(len(train_y), args.batch, args.seed, epoch):
            local.loss_and_grad(xs[idx], train_y[idx])
            sum_grad += local.grads
            local.params -= np.float32(args.local_lr) * local.grads
            step += 1
            if step % args.n_push == 0:
                grads = {n: sum_grad[sl[n]].reshape(shapes[n]).copy() for n in shapes}
                ups, wb, rb, se = method.push(grads)
                pushes += 1
                words_b += wb
                rice_b += rb
                sent += se
                for name, u in ups:
                    if isinstance(u, tuple):  # (shard, Signs) of a compressed shard
                        s, sig = u
                        w = server[sl[name]][s.start : s.stop]
                        a = acc[sl[name]][s.start : s.stop]
                        optim.apply_batch(opt, w, a, [sig], scratch)
                    else:
                        w = server[sl[name]].reshape(shapes[name])
                        a = acc[sl[name]].reshape(shapes[name])
                        optim.apply_batch(opt, w, a, [u], scratch)
                sum_grad[...] = 0.0
            if step % args.n_fetch == 0:
                local.params[...] = server
                if not args.forget_residual and isinstance(method, Strom):
                    for name, tc in method.tcs.items():
                        local.params[sl[name]] -= np.float32(args.local_lr) * tc.residual
    seconds = time.perf_counter() - t0
    evalm = Model(spec)
    evalm.params[...] = server
    accuracy = evalm.accuracy(evalm.prepare(test_x), test_y)
    dense = pushes * server.nbytes
    out = {
        "method": method.name,
        "accuracy": accuracy,
        "pushes": pushes,
        "sent_fraction": sent / (pushes * server.size),
        "ratio_words": dense / words_b,
        "ratio_rice": dense / rice_b,
        "bits_per_update_words": 8 * words_b / sent,
        "bits_per_update_rice": 8 * rice_b / sent,
        "seconds": seconds,
    }
    if isinstance(method, Strom) and method.taus:
        out["median_tau"] = statistics.median(method.taus)
    return out


# -- 3. Table 3 on the real system ------------------------------------------------------------------


def run_cluster(args: argparse.Namespace, root: Path, extra: list[str]) -> dict[str, Any]:
    env = {"ADAMPS_TOKEN": "bench-token", "OPENBLAS_NUM_THREADS": "1"}
    procs: list[Proc] = []
    try:
        ps_port, ds_port = free_port(), free_port()
        ps = Proc(adamps_argv("ps", "--port", str(ps_port), "--data-dir", str(root / "ps"),
                              "--no-lmdb-sync"), root / "ps.log", env=env, name="ps")  # fmt: skip
        ds = Proc(adamps_argv("dataserver", "--port", str(ds_port), "--source", "builtin",
                              "--no-augment"), root / "ds.log", env=env, name="ds")  # fmt: skip
        procs += [ps, ds]
        ps.wait_http(f"http://127.0.0.1:{ps_port}/healthz", 60)
        ds.wait_http(f"http://127.0.0.1:{ds_port}/healthz", 60)
        common = [
            "train", "--ps", f"http://127.0.0.1:{ps_port}",
            "--dataservers", f"http://127.0.0.1:{ds_port}", "--n-replicas", str(args.replicas),
            "--epochs", str(args.epochs), "--seed", str(args.seed), "--metrics-port", "-1",
            "--lr", str(args.lr), "--adagrad-initial", str(args.adagrad_initial), *extra,
        ]  # fmt: skip
        trainers = [
            Proc(adamps_argv(*common, "--replica", str(r)), root / f"train{r}.log", env=env,
                 name=f"train{r}")
            for r in range(args.replicas)
        ]  # fmt: skip
        procs += trainers
        sums = []
        for p in trainers:
            rc = p.popen.wait(args.timeout)
            if rc != 0:
                raise RuntimeError(f"{p.name} exited {rc}: {p.tail(20)}")
            sums.append(json.loads(p.tail(1)))
    finally:
        for p in reversed(procs):
            p.stop(timeout=5)
    images = sum(s["images"] for s in sums)
    pushed = sum(s["bytes_pushed"] for s in sums)
    pushes = sum(s["pushes"] for s in sums)
    fr = [s["sent_fraction"] for s in sums if s.get("sent_fraction") is not None]
    return {
        "accuracy": sums[0]["heldout_accuracy"][str(args.epochs)],
        "images_per_s": sum(s["images_per_s"] for s in sums),
        "bytes_per_image": pushed / images,
        "pushes": pushes,
        "dense_bytes_per_push": 4 * 298_090,
        "bytes_per_push": pushed / max(pushes, 1),
        "sent_fraction": statistics.mean(fr) if fr else None,
    }


# -- main ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--n-push", type=int, default=4)
    p.add_argument("--n-fetch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01, help="server-side Adagrad lr")
    p.add_argument("--adagrad-initial", type=float, default=0.1)
    p.add_argument(
        "--compress-lr-scale",
        type=float,
        default=2.0,
        help="server lr multiplier of compressed training (adamps train --compress-lr-scale)",
    )
    p.add_argument("--local-lr", type=float, default=0.03)
    p.add_argument("--taus", default="0.25,0.5,1,2", help="fixed thresholds of part 2")
    p.add_argument("--fractions", default="0.01,0.003,0.001", help="adaptive fractions of part 2")
    p.add_argument("--cluster-fractions", default="0.01,0.003", help="fractions of part 3")
    p.add_argument("--cluster-taus", default="0.25", help="fixed thresholds of part 3")
    p.add_argument("--coding", default="rice", choices=("words", "rice"), help="part 3 coding")
    p.add_argument("--powersgd-ranks", default="1,4")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--repeats", type=int, default=1, help="cluster runs per setting (part 3)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--speed-elems", type=int, default=1 << 24, help="array size of part 1")
    p.add_argument("--speed-reps", type=int, default=7)
    p.add_argument("--skip-cluster", action="store_true")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument(
        "--forget-residual",
        action="store_true",
        help="part 2: a fetch replaces the local copy without adding the unsent residual back "
        "(adamps train adds it, like the pushes still queued)",
    )
    args = p.parse_args(argv)
    figures: dict[str, Any] = {"epochs": args.epochs, "seed": args.seed}

    print(f"== 1. speed (float32, fraction sent {0.01:.0%}, median of {args.speed_reps}) ==")
    for n in (args.speed_elems, 262_144):
        s = speed(n, 0.01, args.speed_reps)
        key = "speed_large" if n == args.speed_elems else "speed_shard"
        figures[key] = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}
        print(f"  {n:,} elements ({4 * n / 2**20:.0f} MiB), {s['sent']:,} sent:")
        print(
            f"    np.copyto                 {s['copyto_elements_per_s'] / 1e9:6.2f} G elements/s (the limit)"
        )
        for what, key2 in (("encode words", "encode_words"), ("encode rice", "encode_rice"),
                           ("encode adaptive tau", "encode_adaptive"),
                           ("decode+apply words", "decode_apply_words"),
                           ("decode+apply rice", "decode_apply_rice")):  # fmt: skip
            eps = s[f"{key2}_elements_per_s"]
            print(f"    {what:25s} {eps / 1e9:6.2f} G elements/s = "
                  f"{s[f'{key2}_ratio_to_copyto']:.2f} x np.copyto")  # fmt: skip
    print("  (goal: encode >= 0.25 x np.copyto; decode+apply: elements of the shard covered)")

    print(f"\n== 2. adam-mnist, one replica's loop in one process, {args.epochs} epochs, seed "
          f"{args.seed}, server-side Adagrad lr {args.lr} (Strom: x {args.compress_lr_scale}) ==")  # fmt: skip
    data = builtin_data()
    spec = resolve_spec("adam-mnist")
    shapes = Model(spec).tensors()
    layout = Layout([TensorSpec(n, s) for n, s in shapes], 64)
    methods: list[Callable[[], Method]] = [Method]
    methods += [lambda t=float(t): Strom(layout, t, 0.01) for t in args.taus.split(",") if t]
    methods += [lambda f=float(f): Strom(layout, None, f) for f in args.fractions.split(",") if f]
    torch_note = None
    if not args.skip_torch:
        try:
            import torch  # noqa: F401

            methods.append(lambda: TorchHook(shapes, "fp16"))
            methods += [
                lambda r=int(r): TorchHook(shapes, "powersgd", r)
                for r in args.powersgd_ranks.split(",")
                if r
            ]
        except ImportError:
            torch_note = "torch is not installed: no PyTorch peer (pip install torch)"
            print(f"  {torch_note}")
    rows = []
    print(f"  {'method':30s} {'accuracy':>8s} {'sent':>8s} {'ratio':>8s} {'ratio':>8s} "
          f"{'bits/el':>8s} {'bits/el':>8s} {'median':>7s}")  # fmt: skip
    print(f"  {'':30s} {'held-out':>8s} {'elems':>8s} {'words':>8s} {'rice':>8s} "
          f"{'words':>8s} {'rice':>8s} {'tau':>7s}")  # fmt: skip
    for make in methods:
        res = simulate(make(), data, args)
        rows.append(res)
        tau = f"{res['median_tau']:.3g}" if "median_tau" in res else "-"
        print(f"  {res['method']:30s} {res['accuracy']:8.2%} {res['sent_fraction']:8.3%} "
              f"{res['ratio_words']:8.1f} {res['ratio_rice']:8.1f} "
              f"{res['bits_per_update_words']:8.1f} {res['bits_per_update_rice']:8.1f} {tau:>7s}",
              flush=True)  # fmt: skip
    figures["closed_loop"] = [
        {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()} for r in rows
    ]
    if torch_note:
        figures["torch"] = torch_note
    print("  ratio = dense gradient bytes / bytes sent per push (Strom's compression ratio);")
    print("  bits/el: bits per element sent (Strom: per +-tau update); torch hooks send every")
    print("  element: bytes they would all-reduce; accuracy after the same epochs and seed")

    if not args.skip_cluster:
        print(f"\n== 3. Table 3 on the real system: 1 PS, 1 data server, {args.replicas} replicas, "
              f"{args.epochs} epochs, seed {args.seed}, coding {args.coding}, server Adagrad lr "
              f"{args.lr} (compressed: x {args.compress_lr_scale}) ==")  # fmt: skip
        settings: list[tuple[str, list[str]]] = [("uncompressed", [])]
        for f in args.cluster_fractions.split(","):
            if f:
                settings.append((f"fraction {f}", ["--compress", "--compress-fraction", f,
                                                   "--compress-coding", args.coding,
                                                   "--compress-lr-scale",
                                                   str(args.compress_lr_scale)]))  # fmt: skip
        for t in args.cluster_taus.split(","):
            if t:
                settings.append((f"tau {t}", ["--compress", "--compress-tau", t,
                                              "--compress-coding", args.coding,
                                              "--compress-lr-scale",
                                              str(args.compress_lr_scale)]))  # fmt: skip
        if args.compress_lr_scale != 1.0 and args.cluster_fractions:
            f = args.cluster_fractions.split(",")[-1]  # the unscaled lr, for comparison
            settings.append((f"fraction {f} lr x1", ["--compress", "--compress-fraction", f,
                                                      "--compress-coding", args.coding,
                                                      "--compress-lr-scale", "1"]))  # fmt: skip
        table = []
        with tempfile.TemporaryDirectory(prefix="adamps-compression-") as tmp:
            for label, extra in settings:
                for rep in range(args.repeats):
                    root = Path(tmp) / f"{len(table)}-{rep}"
                    root.mkdir()
                    res = run_cluster(args, root, extra)
                    res["setting"] = label
                    res["repeat"] = rep
                    table.append(res)
                    print(f"  ran {label} #{rep}: accuracy {res['accuracy']:.2%}", flush=True)
        base = [r for r in table if r["setting"] == "uncompressed"]
        base_bpi = statistics.mean(r["bytes_per_image"] for r in base)
        base_acc = statistics.mean(r["accuracy"] for r in base)
        print(f"\n  {'tau':20s} {'bytes/image':>12s} {'compression':>12s} {'fewer bytes':>12s} "
              f"{'images/s':>9s} {'held-out':>9s} {'delta':>7s}")  # fmt: skip
        print(f"  {'':20s} {'':>12s} {'ratio':>12s} {'/image':>12s} {'':>9s} {'accuracy':>9s} "
              f"{'pp':>7s}")  # fmt: skip
        summary = []
        for label, _ in settings:
            rs = [r for r in table if r["setting"] == label]
            bpi = statistics.mean(r["bytes_per_image"] for r in rs)
            ratio = statistics.mean(r["dense_bytes_per_push"] / r["bytes_per_push"] for r in rs)
            ips = statistics.mean(r["images_per_s"] for r in rs)
            acc = statistics.mean(r["accuracy"] for r in rs)
            row = {
                "setting": label,
                "bytes_per_image": round(bpi, 1),
                "compression_ratio_vs_dense": round(ratio, 1),
                "fewer_bytes_per_image_x": round(base_bpi / bpi, 1),
                "images_per_s": round(ips, 1),
                "heldout_accuracy": round(acc, 4),
                "delta_accuracy_pp": round(100 * (acc - base_acc), 2),
                "runs": len(rs),
            }
            summary.append(row)
            print(f"  {label:20s} {bpi:12,.0f} {ratio:12.1f} {base_bpi / bpi:11.1f}x {ips:9.0f} "
                  f"{acc:9.2%} {100 * (acc - base_acc):+7.2f}")  # fmt: skip
        print(
            "  compression ratio: dense gradient bytes per push / bytes per push (Strom Table 3);"
        )
        print("  fewer bytes/image: against uncompressed adamps, which sends fc layers as vectors;")
        print(f"  goal: >= 100x fewer bytes per image within 0.3 pp; {args.repeats} run(s) each,")
        print("  held-out set of 1,000 images: one run's standard error is about 0.5 pp")
        figures["table3"] = summary
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
