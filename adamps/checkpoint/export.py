"""``adamps export``: a model's values as one file others read, from a checkpoint directory or
a running cluster (through a checkpoint save into a temporary directory).

    adamps export --from DIR --format npz|safetensors|torch --out model.npz
    adamps export --controllers URL,... --format safetensors --out model.safetensors
    adamps export --table NAME --format safetensors|npy --out emb.safetensors

With ``--table`` it writes one embedding table's ids and rows in id order for serving, streamed
bucket by bucket (adamps/checkpoint/table_files.py: never the whole table in memory).

The file holds each tensor's float32 values under its name (accumulators and embedding rows
stay in the checkpoint): what ``adamps train --init`` and ``numpy.load`` /
``safetensors.numpy.load_file`` read. ``--format torch`` writes a PyTorch ``state_dict``
(``torch.save``) under the parameters' own names, the run prefix and a placement group's tag
(``RUN..{0}fc.weight``: adamps/layout.py) removed (``--run`` picks the
run when the checkpoint holds several): ``model.load_state_dict(torch.load(FILE))``."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from adamps import clusters
from adamps.checkpoint import table_files
from adamps.checkpoint.save_restore import CheckpointError, Cluster, load, save
from adamps.client.rpc import RpcError
from adamps.security import tls

FORMATS = ("npz", "safetensors", "torch")


def export(src: Path, out: Path, fmt: str, run: str | None = None) -> list[str]:
    """The values of checkpoint `src` into `out` (written whole, then renamed); the names."""
    manifest, arrays, _rows = load(src)
    values = {d["name"]: arrays[d["name"]] for d in manifest["tensors"]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    names = sorted(values)
    if fmt == "npz":
        with tmp.open("wb") as f:
            np.savez(f, **values)
    elif fmt == "torch":
        # Imported only for this format: torch is an optional extra (adamps[torch]).
        try:
            sd = importlib.import_module("adamps.torch.state_dict")
        except ImportError as exc:
            raise CheckpointError(f"--format torch needs torch (adamps[torch]): {exc}") from None
        try:
            names = sd.save_state_dict(values, tmp, run)
        except ValueError as exc:
            raise CheckpointError(f"{src}: {exc}") from None
    else:
        save_file(values, str(tmp))
    os.replace(tmp, out)
    return names


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="adamps export", description=__doc__.split("\n\n")[0].replace("\n", " ")
    )
    p.add_argument("--from", dest="src", type=Path, help="checkpoint directory (default: the "
                   "running cluster found as `adamps status` finds it)")  # fmt: skip
    clusters.add_arguments(p)
    p.add_argument("--format", default=None, help="npz (the default), safetensors or torch (a "
                   "state_dict); with --table: safetensors (the default) or npy")  # fmt: skip
    p.add_argument("--table", default=None, help="write this embedding table's ids and rows "
                   "in id order instead of the tensors")  # fmt: skip
    p.add_argument("--run", default=None, help="--format torch: the run whose tensors to write")
    p.add_argument("--out", required=True, type=Path, help="file to write")
    tls.add_arguments(p)
    args = p.parse_args(argv)
    try:
        tls.install_from(args)  # a cluster with TLS on (docs/operations.md, "Security")
    except ValueError as exc:
        print(f"adamps export: {exc}", file=sys.stderr)
        return 2
    if args.src is not None and (args.controllers or args.cluster):
        print("adamps export: give --from (a checkpoint) or a cluster, not both", file=sys.stderr)
        return 2
    if args.run is not None and (args.table or args.format != "torch"):
        # it picked nothing with npz or safetensors: every run's tensors were written, exit 0
        print(f"adamps export: --run {args.run}: expected with --format torch only (a "
              "state_dict of one run's parameters)", file=sys.stderr)  # fmt: skip
        return 2
    formats = table_files.FORMATS if args.table else FORMATS
    if args.format is None:
        args.format = formats[0] if args.table else "npz"
    if args.format not in formats:
        what = "a table (--table) exports as" if args.table else "expected one of"
        hint = " (npy is a table's format: --table)" if args.format == "npy" else ""
        print(
            f"adamps export: --format {args.format!r}: {what} {', '.join(formats)}{hint}",
            file=sys.stderr,
        )
        return 2

    def write(src: Path) -> list[str]:
        if args.table:
            n = table_files.export_table(src, args.table, args.out, args.format)
            return [f"{n} rows of table {args.table!r}"]
        return export(src, args.out, args.format, args.run)

    target = None
    try:
        if args.src is not None:
            names = write(args.src)
        else:
            target = clusters.resolve(args.controllers, args.token, args.cluster, "adamps export")
            cluster = Cluster(target.controllers, target.token)
            try:
                with tempfile.TemporaryDirectory(prefix="adamps-export-") as tmp:
                    save(cluster, Path(tmp))
                    names = write(Path(tmp))
            finally:
                cluster.close()
    except (CheckpointError, table_files.TableFileError) as exc:
        print(f"adamps export: {exc}", file=sys.stderr)
        return 1
    except (RpcError, ConnectionError, TimeoutError) as exc:
        print(f"adamps export: cluster error: {clusters.explain(exc, target)}", file=sys.stderr)
        return 1
    except ValueError as exc:  # no such cluster, no token (clusters.ClusterError, TokenError)
        print(f"adamps export: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # --out in a directory that does not exist or cannot be written
        print(f"adamps export: cannot write {args.out}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if args.table:
        extra = f" (ids in {table_files.ids_path(args.out)})" if args.format == "npy" else ""
        print(f"wrote {names[0]} to {args.out}{extra}")
        return 0
    print(f"wrote {len(names)} tensors to {args.out}")
    return 0
