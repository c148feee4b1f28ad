"""Data server throughput: augmented 28x28 images/s delivered to one client over loopback, beside
the in-memory rate of handing out the same batches without the network (Project Adam 3.1).

    python benchmarks/dataserver.py [--epochs 20] [--batch-size 128] [--repeats 3]

Both sides run the same pipeline (builtin MNIST, 4,000 training images per epoch, augmentation
in one worker process, `ahead` epochs computed in advance) from the same state (the first epochs
already augmented at start): the network side is a real `adamps dataserver` process read by the
prefetching DataClient; the in-memory side iterates DataServer.batches() in this process. It
also prints, for transparency, the rate of the augmentation alone and the serving rates from
epochs that are already cached (no augmentation in the measured interval). Last line: JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


from adamps.up.procs import Proc, adamps_argv, free_port  # noqa: E402
from adamps.wire import protocol  # noqa: E402
from dataserver.augment import AugmentParams, augment_images, epoch_transforms  # noqa: E402
from dataserver.client import DataClient  # noqa: E402
from dataserver.config import DataServerConfig  # noqa: E402
from dataserver.service import DataServer, StreamRequest  # noqa: E402
from dataserver.sources import load_source  # noqa: E402

TOKEN = "bench-token"
N_TRAIN = 4000  #: training images of the builtin dataset


def wait_idle(url: str, timeout: float = 60.0) -> dict:
    """Waits until the server has no augmentation in flight (the same start state as in memory)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(url + "/status", timeout=5) as r:
            st = json.load(r)
        if not st["epochs_in_flight"]:
            return st
        time.sleep(0.05)
    raise TimeoutError("augmentation did not finish")


def drain(client: DataClient, epoch: int, batch_size: int) -> int:
    n = 0
    with client.epoch(0, 1, epoch, batch_size=batch_size, prefetch=8) as it:
        for b in it:
            n += len(b.y)
    return n


def network_run(
    client: DataClient, url: str, args: argparse.Namespace, first: int, epochs: int, cached: bool
) -> float:
    if cached:  # fill the cache with the epochs, then re-read them: serving only
        for e in range(first, first + epochs):
            drain(client, e, args.batch_size)
    else:  # an empty stream (start = end) makes the server augment `first` and `ahead` more
        body = protocol.encode(
            protocol.request(
                "stream", replica=0, n_replicas=1, epoch=first, batch_size=1, start=N_TRAIN
            )
        )
        req = urllib.request.Request(
            url + "/stream", data=body, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
    wait_idle(url)  # the same start state as the in-memory run
    t0 = time.perf_counter()
    n = sum(drain(client, e, args.batch_size) for e in range(first, first + epochs))
    return n / (time.perf_counter() - t0)


async def memory_run(
    server: DataServer, args: argparse.Namespace, first: int, epochs: int, cached: bool
) -> float:
    async def drain_local(e: int) -> int:
        n = 0
        async for b in server.batches(StreamRequest(0, 1, e, 0, args.batch_size, "train")):
            n += len(b.y)
        return n

    if cached:
        for e in range(first, first + epochs):
            await drain_local(e)
    else:
        await server.epoch_images("train", first)
    while server.status()["epochs_in_flight"]:
        await asyncio.sleep(0.01)
    t0 = time.perf_counter()
    n = 0
    for e in range(first, first + epochs):
        n += await drain_local(e)
    return n / (time.perf_counter() - t0)


def augment_only(dataset) -> float:
    x = dataset.train_x
    t = epoch_transforms(len(x), 0, 1, AugmentParams())
    augment_images(x[:100], t[:100])  # imports scipy.ndimage outside the timed part
    t0 = time.perf_counter()
    augment_images(x, t)
    return len(x) / (time.perf_counter() - t0)


async def measure(args: argparse.Namespace, dataset, log_dir: Path) -> dict[str, list[float]]:
    port = free_port()
    env = {"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"}
    argv = adamps_argv(
        "dataserver", "--port", str(port), "--ahead", str(args.ahead), "--log-level", "WARNING"
    )
    proc = Proc(argv, log_dir / "dataserver.log", env=env, name="dataserver")
    url = f"http://127.0.0.1:{port}"
    server = DataServer(DataServerConfig(token=TOKEN, ahead=args.ahead), dataset)
    await server.start()
    out: dict[str, list[float]] = {"net": [], "mem": [], "net_cached": [], "mem_cached": []}
    try:
        proc.wait_http(url + "/healthz", timeout=60)
        client = DataClient([url], TOKEN)
        for i in range(args.repeats):
            first = 100 * (i + 1)  # fresh epochs: nothing augmented yet but what `ahead` prepares
            out["net"].append(
                await asyncio.to_thread(network_run, client, url, args, first, args.epochs, False)
            )
            out["mem"].append(await memory_run(server, args, first, args.epochs, False))
            print(
                f"  run {i + 1}: augmenting pipeline  network {out['net'][-1]:,.0f}  in-memory {out['mem'][-1]:,.0f} images/s"
            )
        for i in range(args.repeats):
            first, n = 10_000 + 10 * i, 2  # epochs read twice: the second time from the cache
            out["net_cached"].append(
                await asyncio.to_thread(network_run, client, url, args, first, n, True)
            )
            out["mem_cached"].append(await memory_run(server, args, first, n, True))
            print(
                f"  run {i + 1}: cached epochs        network {out['net_cached'][-1]:,.0f}  in-memory {out['mem_cached'][-1]:,.0f} images/s"
            )
    finally:
        proc.stop()
        await server.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--epochs", type=int, default=20, help="epochs per measured run (4,000 images each)"
    )
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument(
        "--ahead", type=int, default=2, help="epochs augmented in advance (server default)"
    )
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    dataset = load_source("builtin")
    assert len(dataset.train_y) == N_TRAIN
    log_dir = Path(tempfile.mkdtemp(prefix="bench-dataserver-"))
    print(f"builtin MNIST: {N_TRAIN} training images 28x28 per epoch, batch {args.batch_size}, "
          f"{args.epochs} epochs per run, augmentation in 1 worker process, ahead={args.ahead}, "
          f"{os.cpu_count()} CPUs")  # fmt: skip
    aug = statistics.median(augment_only(dataset) for _ in range(args.repeats))
    print(f"augmentation alone (1 process, scipy affine_transform): {aug:,.0f} images/s")
    r = asyncio.run(measure(args, dataset, log_dir))
    n, m = statistics.median(r["net"]), statistics.median(r["mem"])
    nc, mc = statistics.median(r["net_cached"]), statistics.median(r["mem_cached"])
    print(f"augmented images/s to one client over loopback: {n:,.0f} (goal >= 5,000)")
    print(f"in-memory rate, same batches, no network:       {m:,.0f}")
    print(f"ratio network / in-memory: {n / m:.2f} (goal >= 0.5)")
    print(
        f"serving from cached epochs: network {nc:,.0f} vs in-memory slicing {mc:,.0f} images/s, ratio {nc / mc:.3f}"
    )
    print(
        json.dumps(
            {
                "network_images_per_s": round(n),
                "in_memory_images_per_s": round(m),
                "ratio": round(n / m, 3),
                "augment_only_images_per_s": round(aug),
                "cached_network_images_per_s": round(nc),
                "cached_in_memory_images_per_s": round(mc),
                "cached_ratio": round(nc / mc, 4),
                "goal_images_per_s": 5000,
                "goal_ratio": 0.5,
                "batch_size": args.batch_size,
                "epochs_per_run": args.epochs,
                "repeats": args.repeats,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
