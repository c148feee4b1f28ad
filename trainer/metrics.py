"""The trainer's Prometheus metrics (served on --metrics-port, read by `adamps up`). Written
only: a value the trainer needs itself is kept in its own counters, never read back from here."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class TrainerMetrics:
    """One replica's metrics (its threads set them; nothing in the trainer reads them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.images = Counter(
            "adamps_trainer_images", "training images processed", registry=registry
        )
        self.loss = Gauge(
            "adamps_trainer_loss", "mean training loss of the last rounds", registry=registry
        )
        self.rate = Gauge(
            "adamps_trainer_images_per_second",
            "training images per second (last seconds)",
            registry=registry,
        )
        self.staleness = Gauge(
            "adamps_trainer_fetch_staleness_steps",
            "replica steps taken between the request and the install of the last fetched parameters",
            registry=registry,
        )
        self.bytes_pushed = Counter(
            "adamps_trainer_bytes_pushed",
            "array bytes pushed, by kind",
            ["kind"],
            registry=registry,
        )
        self.pushes = Counter(
            "adamps_trainer_pushes", "tensor pushes, by kind", ["kind"], registry=registry
        )
        self.fetches = Counter(
            "adamps_trainer_fetches", "parameter fetches installed", registry=registry
        )
        self.failovers = Counter(
            "adamps_trainer_failovers",
            "primaries that changed under this replica's calls (each logged once)",
            registry=registry,
        )
        self.merged = Counter(
            "adamps_trainer_pushes_merged",
            "rounds merged into a queued push (network behind)",
            registry=registry,
        )
        self.queue = Gauge(
            "adamps_trainer_push_queue", "pushes waiting for the push thread", registry=registry
        )
        self.accuracy = Gauge(
            "adamps_trainer_heldout_accuracy",
            "held-out accuracy at the last epoch end (replica 0)",
            registry=registry,
        )
        self.epoch = Gauge("adamps_trainer_epoch", "epoch this replica trains", registry=registry)
        self.completed = Gauge(
            "adamps_trainer_completed_epoch", "last epoch complete by the epoch-end rule", registry=registry
        )  # fmt: skip
        self.comp_choices = Counter(
            "adamps_trainer_compression_choices",
            "compression: per pushed tensor, the form sent (the smallest of vectors, "
            "compressed, dense)",
            ["form"],
            registry=registry,
        )
        self.comp_saved = Counter(
            "adamps_trainer_compression_bytes_saved",
            "compression: bytes the same pushes would have taken uncompressed (dense deltas, fc "
            "vectors) minus the bytes sent",
            registry=registry,
        )
        self.comp_sent = Counter(
            "adamps_trainer_compression_elements_sent",
            "compression: tensor elements sent (a vectors or dense push sends all of its tensor)",
            registry=registry,
        )
        self.comp_elements = Counter(
            "adamps_trainer_compression_elements",
            "compression: tensor elements offered to the compressor (sent or kept in the residual)",
            registry=registry,
        )
        self.comp_fraction = Gauge(
            "adamps_trainer_compression_sent_fraction",
            "compression: fraction of the elements sent by the last push",
            registry=registry,
        )
        self.comp_residual = Gauge(
            "adamps_trainer_compression_residual_norm",
            "compression: L2 norm of a tensor's residual (gradient not sent yet)",
            ["tensor"],
            registry=registry,
        )
        self.comp_tau = Gauge(
            "adamps_trainer_compression_tau",
            "compression: the threshold of a tensor's last compressed push",
            ["tensor"],
            registry=registry,
        )
        for kind in ("dense", "fc", "compressed"):
            self.bytes_pushed.labels(kind)
            self.pushes.labels(kind)
        for form in ("vectors", "compressed", "dense"):
            self.comp_choices.labels(form)
