"""What splitting a push into parts costs (issue 30): `PSClient` pushing and pulling a 64 MiB
tensor to one standalone `adamps ps` that takes it in one request (`max_body` 256 MiB, the
default), and to one that takes at most 4 MiB per request (the client cuts every push and pull
into about 17 parts), in the same run, over the data plane and over HTTP; beside the raw
loopback TCP limit (benchmarks/ps_apply.RawTcp, measured in the same run).

    python benchmarks/client_parts.py [--seconds 2] [--rounds 3] [--mib 64] [--max-body-mib 4]

Figures: push+pull bytes per second (GB/s, 1e9 bytes) of one client thread, the median of
`--rounds` samples taken in turn with the loopback limit's (the machine is shared); the ratio
split / whole says what the parts cost. Human-readable lines, then as the last line one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ps_apply import RawTcp  # noqa: E402  (the loopback TCP limit of ps_apply.py)

from adamps.client.ps import PSClient, StaticRouting  # noqa: E402
from adamps.layout import Layout, TensorSpec  # noqa: E402
from adamps.up.procs import Proc, adamps_argv, free_port  # noqa: E402

TOKEN = "bench-client-parts-0123456789abcdef0123456789abcdef"
N_BUCKETS = 64


def sample(base: str, data_port: bool, n: int, seconds: float) -> tuple[float, int]:
    """(GB/s of push+pull, requests per push) of one PSClient against the server at `base`."""
    layout = Layout([TensorSpec("w", (n,))], n_buckets=N_BUCKETS)
    delta = np.full(n, 1e-3, np.float32)
    with PSClient(StaticRouting([base], N_BUCKETS), layout, TOKEN, data_plane=data_port) as c:
        c.push_dense("w", delta)  # warm: connections, limits, data port
        before = c.dp_requests + c.http_requests
        c.push_dense("w", delta)
        per_push = c.dp_requests + c.http_requests - before
        done = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            c.push_dense("w", delta)
            c.pull(["w"])
            done += 1
        return 2 * done * delta.nbytes / (time.perf_counter() - t0) / 1e9, per_push


def start(tmp: str, label: str, max_body: int, n: int) -> tuple[Proc, str]:
    port, dport = free_port(), free_port()
    proc = Proc(
        adamps_argv("ps", "--port", str(port), "--data-port", str(dport),
                    "--n-buckets", str(N_BUCKETS), "--max-body", str(max_body),
                    "--data-dir", str(Path(tmp) / label), "--log-level", "WARNING"),
        Path(tmp) / f"{label}.log", env={"ADAMPS_TOKEN": TOKEN, "OPENBLAS_NUM_THREADS": "1"},
        name=label,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    proc.wait_http(base + "/healthz", 60)
    with PSClient(StaticRouting([base], N_BUCKETS), Layout([], N_BUCKETS), TOKEN) as c:
        c.create(TensorSpec("w", (n,)), init={"kind": "zeros"},
                 optimizer={"kind": "sgd", "lr": -1.0})  # fmt: skip
    return proc, base


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=2.0, help="per sample")
    ap.add_argument("--rounds", type=int, default=3, help="samples per figure, interleaved")
    ap.add_argument("--mib", type=int, default=64, help="the tensor's size")
    ap.add_argument("--max-body-mib", type=int, default=4, help="the splitting server's max_body")
    args = ap.parse_args()
    n = args.mib << 18
    out: dict[str, float | int] = {"mib": args.mib, "max_body_mib": args.max_body_mib}
    samples: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        servers = {
            "whole": start(tmp, "whole", 256 << 20, n),
            "split": start(tmp, "split", args.max_body_mib << 20, n),
        }
        tcp = RawTcp()
        try:
            # Interleaved (a shared, loaded machine drifts): TCP, whole, split, round by round.
            for _ in range(args.rounds):
                samples.setdefault("loopback_tcp", []).append(tcp.stream(args.seconds / 2))
                for transport, dp in (("dataplane", True), ("http", False)):
                    for label, (_proc, base) in servers.items():
                        gbs, per_push = sample(base, dp, n, args.seconds)
                        samples.setdefault(f"{label}_{transport}", []).append(gbs)
                        out[f"{label}_{transport}_requests_per_push"] = per_push
        finally:
            tcp.close()
            for proc, _base in servers.values():
                proc.stop()
    for key, got in samples.items():
        out[f"{key}_gbs"] = round(statistics.median(got), 3)
    print(f"raw loopback TCP (4 MiB messages, one connection): {out['loopback_tcp_gbs']:.2f} GB/s")
    for transport in ("dataplane", "http"):
        for label, mb in (("whole", 256), ("split", args.max_body_mib)):
            print(f"{label:5} max_body {mb:4d} MiB, {transport:9}: "
                  f"{out[f'{label}_{transport}_gbs']:.2f} GB/s push+pull (median of {args.rounds}), "
                  f"{out[f'{label}_{transport}_requests_per_push']} request(s) per push")  # fmt: skip
        ratio = out[f"split_{transport}_gbs"] / out[f"whole_{transport}_gbs"]
        out[f"ratio_{transport}"] = round(ratio, 3)
        print(f"{transport}: split / whole = {ratio:.2f}; whole / loopback TCP = "
              f"{out[f'whole_{transport}_gbs'] / out['loopback_tcp_gbs']:.2f}")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
