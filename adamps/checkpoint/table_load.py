"""``adamps table load``: an embedding table's rows loaded from a file into a running cluster.

    adamps table load --table NAME --from emb.safetensors|emb.npy|CHECKPOINT_DIR

The source (adamps/checkpoint/table_files.py): an ``adamps export --table`` file (``.safetensors``, or
``.npy`` with its ``.ids.npy``), a dense 2-D ``.npy`` whose row index is the id, or a checkpoint
directory's table (``--source-table``, default ``--table``). Rows go in batches through the push
path (``PSClient.put_rows``: replicated, exactly once by (client, seq)); each row takes the
file's values and its optimizer state starts afresh. Backpressure: a server that cannot make
its writes durable fast enough answers ``not_durable`` and applies nothing; the client retries
the buckets not applied for ``--retry-for`` seconds, and past that this command waits and sends
the same batch again with the same seq, so the buckets that did apply drop it as a duplicate and
only the refused ones apply it. The table is created first when it does not exist (with the
checkpoint's definition, or ``--optimizer``: zeros init, the file's dim).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from adamps import clusters
from adamps.checkpoint import table_files
from adamps.checkpoint.format import CheckpointError, read_manifest
from adamps.checkpoint.save_restore import Cluster
from adamps.client import PartialPushError, PSClient
from adamps.client.rpc import RpcError
from adamps.layout import Layout
from adamps.optspec import OptimError, Optimizer
from adamps.security import tls

#: rows per put_rows (a request names at most 262,144 ids: tableops.MAX_IDS)
BATCH = 50_000
#: a batch refused past the client's retries is sent again this many times before giving up
MAX_ROUNDS = 20


def load(
    cluster: Cluster,
    table: str,
    src: Path,
    source_table: str | None = None,
    optimizer: dict[str, Any] | None = None,
    batch: int = BATCH,
    wait: float = 2.0,
) -> dict[str, Any]:
    """Loads `src`'s rows into `table`; {"rows", "seconds", "resent"}."""
    t0 = time.perf_counter()
    n, dim, batches = table_files.read_rows(src, source_table or table)
    statuses = cluster.server_status()
    if not statuses:
        raise table_files.TableFileError("the cluster has no parameter server to load onto")
    layout = Layout(
        [], int(statuses[0]["n_buckets"]), int(statuses[0]["config"]["max_shard_elems"])
    )
    held: dict[str, Any] = {}
    for _url, rpc in cluster.live_servers():
        for t in rpc.call("list_tables")["tables"]:
            held.setdefault(t["name"], t)
    have = held.get(table)
    client = PSClient(cluster.source, layout, cluster.token, retry_for=cluster.retry_for)
    try:
        if have is None:
            d = _definition(src, source_table or table, optimizer)
            if d is None:
                raise table_files.TableFileError(
                    f"no table {table!r} on the cluster: create it first, or give --optimizer "
                    '(e.g. \'{"kind": "rowwise_adagrad", "lr": 0.05}\') to create it'
                )
            client.create_table(table, dim, init=d.get("init"), optimizer=d.get("optimizer"),
                                admission=d.get("admission"), dtype=d.get("dtype"))  # fmt: skip
        elif int(have["dim"]) != dim:
            raise table_files.TableFileError(
                f"{src}: rows of dim {dim}, table {table!r} on the cluster has dim {have['dim']}"
            )
        client.tables[table] = dim
        rows = resent = 0
        for ids, values in batches(batch):
            if not len(ids):
                continue
            resent += _put(client, table, ids, values, wait)
            rows += len(ids)
    finally:
        client.close()
    return {"rows": rows, "seconds": time.perf_counter() - t0, "resent": resent, "expected": n}


def _put(client: PSClient, table: str, ids: Any, values: Any, wait: float) -> int:
    """One batch, exactly once: re-sent with its seq while servers refuse it as not durable."""
    seq = None
    for resent in range(MAX_ROUNDS):
        try:
            client.put_rows(table, ids, values, seq=seq)
            return resent
        except PartialPushError as exc:
            if exc.code != "not_durable":
                raise
            seq = exc.seq  # the buckets applied drop it as a duplicate; the others apply it
        except RpcError as exc:
            if exc.code != "not_durable":
                raise
            seq = client.next_seq() if seq is None else seq  # nothing applied
        time.sleep(wait)
    raise table_files.TableFileError(
        f"table {table!r}: the servers refused a batch as not durable {MAX_ROUNDS} times"
    )


def _definition(src: Path, table: str, optimizer: dict[str, Any] | None) -> dict[str, Any] | None:
    """The definition a missing table is created with: --optimizer's, else a checkpoint's."""
    if optimizer is not None:
        return {"init": {"kind": "zeros"}, "optimizer": optimizer}
    if src.is_dir():
        for t in read_manifest(src).get("tables", []):
            if t.get("name") == table:
                return t
    return None


USAGE = "usage: adamps table load --table NAME --from FILE  (adamps table load --help)"


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(f"{USAGE}\n\n{__doc__}")
        return 0
    if not argv or argv[0] != "load":
        print(f"adamps table: expected the subcommand 'load'\n{USAGE}", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="adamps table load", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", required=True, help="the table to load into")
    p.add_argument("--from", dest="src", required=True, type=Path,
                   help=".safetensors or .npy (adamps export --table), a dense 2-D .npy, or a "
                   "checkpoint directory")  # fmt: skip
    p.add_argument("--source-table", default=None, help="the checkpoint's table (default --table)")
    p.add_argument("--optimizer", default=None,
                   help="JSON: create the table with this optimizer when it does not exist")  # fmt: skip
    p.add_argument("--batch", type=int, default=BATCH, help=f"rows per request ({BATCH})")
    clusters.add_arguments(p)
    tls.add_arguments(p)
    args = p.parse_args(argv[1:])
    if not 1 <= args.batch <= 262_144:
        print(f"adamps table load: --batch {args.batch}: expected 1 to 262144", file=sys.stderr)
        return 2
    opt = None
    if args.optimizer is not None:
        try:
            opt = json.loads(args.optimizer)
            if not isinstance(opt, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            print(f"adamps table load: --optimizer {args.optimizer!r}: expected a JSON object "
                  f'like {{"kind": "sgd", "lr": 0.1}}: {exc}', file=sys.stderr)  # fmt: skip
            return 2
        try:  # the servers' own check, before anything is read or sent (it was exit code 1,
            # "cluster error: bad_request", after the file's pass)
            Optimizer.from_dict(opt).check_for_table()
        except OptimError as exc:
            print(f"adamps table load: --optimizer {args.optimizer!r}: {exc}", file=sys.stderr)
            return 2
    target = None
    try:
        tls.install_from(args)
        target = clusters.resolve(args.controllers, args.token, args.cluster, "adamps table")
        cluster = Cluster(target.controllers, target.token)
        try:
            got = load(cluster, args.table, args.src, args.source_table, opt, args.batch)
        finally:
            cluster.close()
    except (table_files.TableFileError, CheckpointError) as exc:
        print(f"adamps table load: {exc}", file=sys.stderr)
        return 1
    except (RpcError, PartialPushError, ConnectionError, TimeoutError) as exc:
        print(f"adamps table load: cluster error: {clusters.explain(exc, target)}", file=sys.stderr)
        return 1
    except ValueError as exc:  # no such cluster, no token, a bad TLS setting
        print(f"adamps table load: {exc}", file=sys.stderr)
        return 2
    rate = got["rows"] / max(got["seconds"], 1e-9)
    print(f"loaded {got['rows']} rows into table {args.table!r} in {got['seconds']:.1f} s "
          f"({rate:,.0f} rows/s; {got['resent']} batches re-sent after not_durable)")  # fmt: skip
    return 0
