"""The cluster dashboard's panels: parameter servers (updates, traffic, durability, replication,
leases) and controllers. Rendered by deploy/grafana/dashboards.py."""

from __future__ import annotations

from dashboard_model import Dashboard, Panel, quantile, rate

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
