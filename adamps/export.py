"""``adamps export``: a model's values as one file others read, from a checkpoint directory or
a running cluster (through a checkpoint save into a temporary directory).

    adamps export --from DIR --format npz|safetensors --out model.npz
    adamps export --controllers URL,... --format safetensors --out model.safetensors

The file holds each tensor's float32 values under its name (accumulators and embedding rows
stay in the checkpoint): what ``adamps train --init`` and ``numpy.load`` /
``safetensors.numpy.load_file`` read."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from adamps.checkpoint import CheckpointError, Cluster, load, save
from adamps.rpc import RpcError

FORMATS = ("npz", "safetensors")


def export(src: Path, out: Path, fmt: str) -> list[str]:
    """The values of checkpoint `src` into `out` (written whole, then renamed); the names."""
    manifest, arrays, _rows = load(src)
    values = {d["name"]: arrays[d["name"]] for d in manifest["tensors"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    if fmt == "npz":
        with tmp.open("wb") as f:
            np.savez(f, **values)
    else:
        save_file(values, str(tmp))
    os.replace(tmp, out)
    return sorted(values)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="adamps export", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from", dest="src", type=Path, help="checkpoint directory")
    src.add_argument("--controllers", help="comma-separated controller URLs of a running cluster")
    p.add_argument("--token", default=None, help="cluster token (default: $ADAMPS_TOKEN)")
    p.add_argument("--format", default="npz", help="npz or safetensors")
    p.add_argument("--out", required=True, type=Path, help="file to write")
    args = p.parse_args(argv)
    if args.format not in FORMATS:
        print(
            f"adamps export: --format {args.format!r}: expected one of {', '.join(FORMATS)}",
            file=sys.stderr,
        )
        return 2
    try:
        if args.src is not None:
            names = export(args.src, args.out, args.format)
        else:
            cluster = Cluster([c for c in args.controllers.split(",") if c], args.token)
            try:
                with tempfile.TemporaryDirectory(prefix="adamps-export-") as tmp:
                    save(cluster, Path(tmp))
                    names = export(Path(tmp), args.out, args.format)
            finally:
                cluster.close()
    except CheckpointError as exc:
        print(f"adamps export: {exc}", file=sys.stderr)
        return 1
    except (RpcError, ConnectionError, TimeoutError) as exc:
        print(f"adamps export: cluster error: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0
