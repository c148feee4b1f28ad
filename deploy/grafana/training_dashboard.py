"""The training dashboard's panels: trainer replicas and data servers. Rendered by
deploy/grafana/dashboards.py."""

from __future__ import annotations

from dashboard_model import RATE, Dashboard, Panel, rate

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
