"""Writes the Grafana dashboards in deploy/grafana/dashboards/ from the panel list below.

    python deploy/grafana/dashboards.py          # regenerate the JSON files
    python deploy/grafana/dashboards.py --check  # list panels whose metrics the code lacks

Why generated: the panels are one readable table (title, unit, PromQL), the JSON boilerplate is
the same for all of them, and the generator can tell which expected metric names the code does
not define yet. A panel whose metrics are not all defined by the code is left out of the JSON
(and printed), so a dashboard never shows a query that can only be empty.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from metric_names import exposed_metrics  # noqa: E402

OUT = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "adamps-prometheus"}
METRIC_RE = re.compile(r"\badamps_[A-Za-z0-9_:]+")
RATE = "1m"  # rate window: >= 4 scrapes at the Compose file's 5 s scrape interval


@dataclass
class Panel:
    title: str
    #: (PromQL, legend) pairs
    queries: list[tuple[str, str]]
    unit: str = "short"
    kind: str = "timeseries"
    description: str = ""
    width: int = 12


@dataclass
class Dashboard:
    uid: str
    title: str
    description: str
    #: (row title, panels)
    rows: list[tuple[str, list[Panel]]] = field(default_factory=list)


def rate(metric: str, by: str = "instance") -> str:
    return f"sum by ({by}) (rate({metric}[{RATE}]))"


def quantile(q: float, metric: str, by: str = "instance") -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket[{RATE}])))"


CLUSTER = Dashboard(
    uid="adamps-cluster",
    title="adamps: parameter servers and controllers",
    description="Update rate and latency per parameter server, traffic, durability (loss window), "
    "replication and leases (Project Adam 3.3).",
    rows=[
        (
            "Parameter servers: updates",
            [
                Panel(
                    "Updates applied per server (by kind)",
                    [
                        (
                            rate("adamps_ps_updates_applied_total", "instance, kind"),
                            "{{instance}} {{kind}}",
                        )
                    ],
                    unit="ops",
                ),
                Panel(
                    "RPC requests per server (by op)",
                    [(rate("adamps_ps_requests_total", "instance, op"), "{{instance}} {{op}}")],
                    unit="reqps",
                ),
                Panel(
                    "Request latency p50 / p99 per server",
                    [
                        (quantile(0.5, "adamps_ps_request_latency_seconds"), "p50 {{instance}}"),
                        (quantile(0.99, "adamps_ps_request_latency_seconds"), "p99 {{instance}}"),
                    ],
                    unit="s",
                    description="From a complete request body to its reply; pushes until applied.",
                ),
                Panel(
                    "Bytes in / out per server",
                    [
                        (rate("adamps_ps_bytes_in_total"), "in {{instance}}"),
                        (rate("adamps_ps_bytes_out_total"), "out {{instance}}"),
                    ],
                    unit="Bps",
                ),
                Panel(
                    "Owner-thread queue depth",
                    [("sum by (instance) (adamps_ps_queue_depth)", "{{instance}}")],
                ),
                Panel(
                    "Shards held per server",
                    [("sum by (instance) (adamps_ps_shards)", "{{instance}}")],
                ),
            ],
        ),
        (
            "Parameter servers: durability",
            [
                Panel(
                    "Loss window (age of the oldest unflushed update)",
                    [("max by (instance) (adamps_ps_loss_window_seconds)", "{{instance}}")],
                    unit="s",
                    description="What a crash of the server now would lose (Adam 3.3.2).",
                ),
                Panel(
                    "Dirty shards",
                    [("sum by (instance) (adamps_ps_dirty_shards)", "{{instance}}")],
                ),
                Panel(
                    "Flush duration p99",
                    [
                        (quantile(0.99, "adamps_ps_flush_seconds"), "flush p99 {{instance}}"),
                    ],
                    unit="s",
                ),
                Panel(
                    "Bytes flushed to LMDB",
                    [(rate("adamps_ps_flushed_bytes_total"), "{{instance}}")],
                    unit="Bps",
                ),
                Panel(
                    "Durable (1) / not acknowledging (0) and last flush age",
                    [
                        ("min by (instance) (adamps_ps_durable)", "durable {{instance}}"),
                        (
                            "max by (instance) (adamps_ps_last_flush_age_seconds)",
                            "last flush age {{instance}}",
                        ),
                    ],
                    description="Issue 29: a server whose updates stay unflushed past "
                    "max_unflushed (disk full, failing or stalled) answers pushes 503 "
                    "not_durable and its buckets move; /healthz names the cause.",
                ),
                Panel(
                    "Corrupt records (checksum failures) and digest conflicts",
                    [
                        (
                            "sum by (instance, where) (increase(adamps_ps_corrupt_records_total[5m]))",
                            "{{where}} {{instance}}",
                        ),
                        ("max(adamps_controller_digest_conflicts)", "digest conflicts"),
                    ],
                    description="Issue 29: records that failed their checksum (never served; "
                    "the copy rejoins by state transfer), and tied copies that disagreed.",
                ),
            ],
        ),
        (
            "Replication and leases",
            [
                Panel(
                    "Replication lag per server (max over its buckets)",
                    [("max by (instance) (adamps_ps_replication_lag_batches)", "{{instance}}")],
                    description="Batches committed on the primary that its slowest secondary has not committed.",
                ),
                Panel(
                    "2PC round latency p50 / p99 (as primary)",
                    [
                        (quantile(0.5, "adamps_ps_replication_round_seconds"), "p50 {{instance}}"),
                        (quantile(0.99, "adamps_ps_replication_round_seconds"), "p99 {{instance}}"),
                    ],
                    unit="s",
                ),
                Panel(
                    "Client pushes per 2PC round (mean)",
                    [
                        (
                            "sum by (instance) (rate(adamps_ps_replication_round_pushes_sum[1m]))"
                            " / sum by (instance) (rate(adamps_ps_replication_round_pushes_count[1m]))",
                            "{{instance}}",
                        )
                    ],
                    description="Many client pushes ride one round: the batching that keeps replication cheap.",
                ),
                Panel(
                    "Lease epoch per server (highest of its primary buckets)",
                    [("max by (instance) (adamps_ps_lease_epoch_max)", "{{instance}}")],
                    description="The fencing token; it grows at every failover of a bucket.",
                ),
                Panel(
                    "Primary buckets per server",
                    [("sum by (instance) (adamps_ps_primary_buckets)", "{{instance}}")],
                ),
                Panel(
                    "Failovers (buckets taken over as primary)",
                    [
                        (
                            "sum by (instance) (increase(adamps_ps_failovers_total[5m]))",
                            "{{instance}} / 5 min",
                        ),
                    ],
                ),
                Panel(
                    "Stale-epoch messages rejected / pushes deduplicated",
                    [
                        (rate("adamps_ps_stale_epoch_rejected_total"), "stale {{instance}}"),
                        (rate("adamps_ps_deduplicated_pushes_total"), "dedup {{instance}}"),
                    ],
                    unit="ops",
                ),
                Panel(
                    "Secondaries dropped and state transfers",
                    [
                        (
                            "sum by (instance) (increase(adamps_ps_secondaries_dropped_total[5m]))",
                            "dropped {{instance}}",
                        ),
                        (
                            "sum by (instance, direction) (increase(adamps_ps_state_transfers_total[5m]))",
                            "transfer {{direction}} {{instance}}",
                        ),
                    ],
                ),
            ],
        ),
        (
            "Controllers",
            [
                Panel(
                    "Targets up",
                    [("sum by (job) (up)", "{{job}}")],
                    kind="stat",
                    width=6,
                ),
                Panel(
                    "Raft leader and term",
                    [
                        ("max by (instance) (adamps_controller_is_leader)", "leader {{instance}}"),
                        ("max(adamps_controller_raft_term)", "term"),
                    ],
                    width=6,
                ),
                Panel(
                    "Parameter servers by state",
                    [("max by (state) (adamps_controller_servers)", "{{state}}")],
                ),
                Panel(
                    "Servers declared dead",
                    [
                        (
                            "sum(increase(adamps_controller_servers_declared_dead_total[5m]))",
                            "per 5 min",
                        )
                    ],
                    description="Counted by the leader that declared them; a failover follows each.",
                ),
                Panel(
                    "Under-replicated and unassigned buckets",
                    [
                        ("max(adamps_controller_under_replicated_buckets)", "under-replicated"),
                        ("sum(adamps_ps_under_replicated_buckets)", "under-replicated (PS view)"),
                        ("max(adamps_controller_unassigned_buckets)", "without a lease holder"),
                    ],
                ),
                Panel(
                    "Unavailable and lost buckets",
                    [
                        ("max(adamps_controller_unavailable_buckets)", "unavailable"),
                        ("max(adamps_controller_buckets_declared_lost)", "declared lost"),
                    ],
                    description=(
                        "Unavailable: every copy's server is gone; pushes and pulls get 503 "
                        "bucket_unavailable until one comes back with its copy. Lost: given up "
                        "by an operator (POST /buckets/{b}/declare-lost)."
                    ),
                ),
                Panel(
                    "Routing table version",
                    [("max(adamps_controller_table_version)", "version")],
                    description="Grows with every placement change (registrations, failovers, moves).",
                ),
                Panel(
                    "Controller writes by op and result",
                    [(rate("adamps_controller_writes_total", "op, result"), "{{op}} {{result}}")],
                    unit="ops",
                ),
                Panel(
                    "Raft commit latency p99",
                    [(quantile(0.99, "adamps_controller_commit_seconds"), "p99 {{instance}}")],
                    unit="s",
                ),
                Panel(
                    "Raft commit index",
                    [("max by (instance) (adamps_controller_commit_index)", "{{instance}}")],
                ),
                Panel(
                    "Periodic checkpoints: age and duration",
                    [
                        ("min(adamps_controller_checkpoint_age_seconds)", "age"),
                        ("max(adamps_controller_checkpoint_duration_seconds)", "duration"),
                        ("max(adamps_controller_checkpoint_interval_seconds)", "interval"),
                    ],
                    unit="s",
                    description="From the controllers' replicated record (issue 24): the age "
                    "of the newest checkpoint, how long it took, and checkpoint_interval. An "
                    "alert fires past 3 intervals (deploy/prometheus/alerts.yml).",
                ),
                Panel(
                    "Periodic checkpoints: size",
                    [
                        ("max(adamps_controller_checkpoint_bytes)", "named (whole model)"),
                        ("max(adamps_controller_checkpoint_written_bytes)", "written (changed)"),
                    ],
                    unit="bytes",
                    description="An incremental checkpoint writes only the shards and rows "
                    "changed since the previous one and names the earlier files for the rest.",
                ),
                Panel(
                    "Periodic checkpoints failed (1 h)",
                    [("sum(increase(adamps_controller_checkpoint_failures_total[1h]))", "failed")],
                    kind="stat",
                    width=6,
                    description="Counted by the leader that began them; each is logged.",
                ),
            ],
        ),
    ],
)

TRAINING = Dashboard(
    uid="adamps-training",
    title="adamps: training and data",
    description="Trainer replicas (images/s, loss, held-out accuracy, parameter staleness) and "
    "data-server throughput (Project Adam 3.1-3.2).",
    rows=[
        (
            "Trainers",
            [
                Panel(
                    "Images/s per replica",
                    [
                        (rate("adamps_trainer_images_total"), "{{instance}}"),
                        ("sum(rate(adamps_trainer_images_total[1m]))", "all replicas"),
                    ],
                    unit="short",
                ),
                Panel(
                    "Training loss per replica",
                    [("max by (instance) (adamps_trainer_loss)", "{{instance}}")],
                ),
                Panel(
                    "Held-out accuracy (at each epoch end)",
                    [("max(adamps_trainer_heldout_accuracy)", "held-out accuracy")],
                    unit="percentunit",
                ),
                Panel(
                    "Epochs: trained per replica and complete (epoch-end rule)",
                    [
                        ("max by (instance) (adamps_trainer_epoch)", "training {{instance}}"),
                        ("max(adamps_trainer_completed_epoch)", "complete"),
                    ],
                ),
                Panel(
                    "Staleness of fetched parameters",
                    [("max by (instance) (adamps_trainer_fetch_staleness_steps)", "{{instance}}")],
                    description="Replica steps between a fetch's request and its install.",
                ),
                Panel(
                    "Bytes pushed by kind",
                    [
                        (
                            rate("adamps_trainer_bytes_pushed_total", "instance, kind"),
                            "{{instance}} {{kind}}",
                        )
                    ],
                    unit="Bps",
                    description="dense: accumulated deltas; fc: activation and error vectors (Adam 3.2.3).",
                ),
                Panel(
                    "Pushes by kind and fetches",
                    [
                        (
                            rate("adamps_trainer_pushes_total", "instance, kind"),
                            "push {{kind}} {{instance}}",
                        ),
                        (rate("adamps_trainer_fetches_total"), "fetch {{instance}}"),
                    ],
                    unit="ops",
                ),
                Panel(
                    "Compression (Strom): bytes sent and saved, elements sent",
                    [
                        (rate("adamps_trainer_bytes_pushed_total"), "sent {{instance}}"),
                        (
                            rate("adamps_trainer_compression_bytes_saved_total"),
                            "saved {{instance}}",
                        ),
                    ],
                    unit="Bps",
                    description="With --compress: payload bytes pushed, and the bytes the same "
                    "pushes would have taken uncompressed minus those (Strom 2.5).",
                ),
                Panel(
                    "Compression: fraction of elements sent, residual norm",
                    [
                        (
                            "sum by (instance) (rate(adamps_trainer_compression_elements_sent_total[1m]))"
                            " / sum by (instance) (rate(adamps_trainer_compression_elements_total[1m]))",
                            "sent fraction {{instance}}",
                        ),
                        (
                            "max by (instance, tensor) (adamps_trainer_compression_residual_norm)",
                            "residual {{instance}} {{tensor}}",
                        ),
                    ],
                    description="Elements sent / elements offered per push (the target of the "
                    "adaptive tau); the L2 norm of each tensor's residual (gradient not yet "
                    "sent: error feedback, Strom 2.4). A residual that keeps growing means tau is "
                    "too high for that tensor.",
                ),
                Panel(
                    "Model parallelism: bytes sent to the other partitions",
                    [
                        (
                            rate(
                                "adamps_trainer_partition_bytes_exchanged_total",
                                "instance, partition",
                            ),
                            "{{instance}} partition {{partition}}",
                        ),
                    ],
                    unit="Bps",
                    description="With --partitions K: activations and errors crossing the "
                    "vertical cut, sent by each partition (DistBelief 3: each once per "
                    "partition that needs it).",
                ),
                Panel(
                    "Model parallelism: time waiting for the other partitions",
                    [
                        (
                            rate(
                                "adamps_trainer_partition_wait_seconds_total", "instance, partition"
                            ),
                            "{{instance}} partition {{partition}}",
                        ),
                    ],
                    unit="percentunit",
                    description="Seconds per second a partition's workers waited for their "
                    "peers (summed over its workers): the imbalance and latency of the cut.",
                ),
                Panel(
                    "Push queue and merged rounds (network behind)",
                    [
                        ("max by (instance) (adamps_trainer_push_queue)", "queued {{instance}}"),
                        (rate("adamps_trainer_pushes_merged_total"), "merged/s {{instance}}"),
                    ],
                ),
            ],
        ),
        (
            "Runs (namespace, token, quotas)",
            [
                Panel(
                    "Parameter elements per run",
                    [("max by (run) (adamps_run_param_elems)", "{{run}}")],
                    description="Every server holds every tensor's definition: the max is the "
                    "run's total.",
                ),
                Panel(
                    "Bytes held per run (all copies)",
                    [("sum by (run) (adamps_run_held_bytes)", "{{run}}")],
                    unit="bytes",
                ),
                Panel(
                    "Push bytes/s per run",
                    [(rate("adamps_run_push_bytes_total", "run"), "{{run}}")],
                    unit="Bps",
                ),
                Panel(
                    "Quota use per run",
                    [
                        (
                            "max by (run) (adamps_run_param_elems) / max by (run) "
                            '(adamps_run_quota{quota="param_elems"})',
                            "{{run}} parameter elements",
                        ),
                        (
                            f"max by (run) (rate(adamps_run_push_bytes_total[{RATE}]) / on "
                            '(instance, run) adamps_run_quota{quota="push_bytes_per_s"})',
                            "{{run}} push bytes/s (busiest server)",
                        ),
                    ],
                    unit="percentunit",
                    description="1 = at the quota. The push-rate quota holds on each server.",
                ),
                Panel(
                    "Requests refused per run (namespace, quota)",
                    [(rate("adamps_run_refused_total", "run, reason"), "{{run}} {{reason}}")],
                    unit="ops",
                ),
            ],
        ),
        (
            "Data servers",
            [
                Panel(
                    "Images served per data server (by split)",
                    [
                        (
                            rate("adamps_dataserver_images_served_total", "instance, split"),
                            "{{instance}} {{split}}",
                        )
                    ],
                    unit="short",
                ),
                Panel(
                    "Images augmented per second",
                    [(rate("adamps_dataserver_images_augmented_total"), "{{instance}}")],
                    unit="short",
                ),
                Panel(
                    "Augmentation backlog",
                    [
                        (
                            "sum by (instance) (adamps_dataserver_augment_backlog_images)",
                            "{{instance}}",
                        )
                    ],
                ),
                Panel(
                    "Cache bytes",
                    [("sum by (instance) (adamps_dataserver_cache_bytes)", "{{instance}}")],
                    unit="bytes",
                ),
                Panel(
                    "Open streams",
                    [("sum by (instance) (adamps_dataserver_streams_open)", "{{instance}}")],
                ),
                Panel(
                    "Streams that waited for augmentation / files skipped",
                    [
                        (
                            "sum by (instance) (adamps_dataserver_stream_waits_total)",
                            "waits {{instance}}",
                        ),
                        (
                            "sum by (instance) (adamps_dataserver_skipped_files_total)",
                            "skipped {{instance}}",
                        ),
                    ],
                ),
            ],
        ),
    ],
)

DASHBOARDS = [CLUSTER, TRAINING]


def panel_metrics(panel: Panel) -> set[str]:
    return {m for expr, _legend in panel.queries for m in METRIC_RE.findall(expr)}


def _panel_json(panel: Panel, pid: int, x: int, y: int) -> dict:
    targets = [
        {"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": expr, "legendFormat": legend}
        for i, (expr, legend) in enumerate(panel.queries)
    ]
    out: dict = {
        "id": pid,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": panel.unit}, "overrides": []},
        "targets": targets,
    }
    if panel.kind == "timeseries":
        out["options"] = {
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
            "tooltip": {"mode": "multi", "sort": "desc"},
        }
    else:
        out["options"] = {
            "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}
        }
    return out


def render(dash: Dashboard, defined: set[str]) -> tuple[dict, list[tuple[str, list[str]]]]:
    """The dashboard's JSON model, and the (panel, missing metrics) left out."""
    panels: list[dict] = []
    left_out: list[tuple[str, list[str]]] = []
    pid, y = 1, 0
    for row_title, row_panels in dash.rows:
        kept = []
        for p in row_panels:
            missing = sorted(panel_metrics(p) - defined)
            if missing:
                left_out.append((p.title, missing))
            else:
                kept.append(p)
        if not kept:
            continue
        panels.append(
            {"id": pid, "type": "row", "title": row_title, "collapsed": False, "panels": [],
             "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}}
        )  # fmt: skip
        pid, y, x = pid + 1, y + 1, 0
        for p in kept:
            if x + p.width > 24:
                x, y = 0, y + 8
            panels.append(_panel_json(p, pid, x, y))
            pid, x = pid + 1, x + p.width
        y += 8
    model = {
        "uid": dash.uid,
        "title": dash.title,
        "description": dash.description,
        "tags": ["adamps"],
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "5s",
        "time": {"from": "now-30m", "to": "now"},
        "timezone": "",
        "graphTooltip": 1,
        "annotations": {"list": []},
        "templating": {"list": []},
        "links": [],
        "panels": panels,
    }
    return model, left_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report; write nothing")
    args = ap.parse_args(argv)
    defined = set(exposed_metrics())
    for dash in DASHBOARDS:
        model, left_out = render(dash, defined)
        path = OUT / f"{dash.uid}.json"
        if not args.check:
            path.write_text(json.dumps(model, indent=2) + "\n")
        n = sum(1 for p in model["panels"] if p["type"] != "row")
        print(f"{path.relative_to(OUT.parents[2])}: {n} panels")
        for title, missing in left_out:
            print(f"  left out {title!r}: the code does not define {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
