"""The trainer's configuration (TOML table ``[train]``, env ``ADAMPS_TRAIN_<FIELD>``, flags)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from adamps.config import default_token
from adamps.optspec import OptimError, Optimizer, spec_of
from adamps.security import token as tokens
from adamps.up.train_flags import TrainFlags


@dataclass
class TrainConfig(TrainFlags):
    """`adamps train`'s flags (adamps/up/train_flags.py) with their checks."""

    @property
    def server_lr(self) -> float:
        """The learning rate the tensors are created with (``lr``, scaled for compressed
        training with Adagrad)."""
        if self.compress and self.optimizer in ("adagrad", "adagrad_legacy"):
            return self.lr * self.compress_lr_scale
        return self.lr

    @property
    def optimizer_params(self) -> dict[str, Any]:
        """--optimizer-args parsed (OptimError when it is not a JSON object)."""
        if not self.optimizer_args.strip():
            return {}
        try:
            got = json.loads(self.optimizer_args)
        except ValueError as exc:
            raise OptimError(
                f"optimizer_args is not JSON ({exc}): {self.optimizer_args!r}"
            ) from None
        if not isinstance(got, dict):
            raise OptimError(f"optimizer_args must be a JSON object, got {self.optimizer_args!r}")
        return got

    def optimizer_spec(self) -> dict[str, Any]:
        """The optimizer every tensor is created with (checked: OptimError names the problem)."""
        spec = spec_of(self.optimizer, self.server_lr, self.adagrad_initial, self.optimizer_params)
        Optimizer.from_dict(spec).check_for_tensor()
        return spec

    def check_mode(self) -> None:
        """The consistency mode (given, or read from the run's record) fits this trainer."""
        if self.consistency not in ("", "async") and (
            self.partitions > 1 or self.torch or self.coordinator
        ):
            raise ValueError(
                f"consistency {self.consistency} is for Downpour replicas (numpy models): "
                "no --partitions, --torch or --coordinator"
            )

    def __post_init__(self) -> None:
        #: an elastic replica (trainer/elastic.py): --run without --replica (Downpour, numpy)
        self.elastic = bool(
            self.replica < 0
            and self.run
            and self.job_index < 0
            and self.partitions == 1
            and not self.torch
            and not self.coordinator
        )
        if self.replica < 0 and self.job_index < 0:
            self.replica = 0  # an elastic replica does replica 0's duties (tensors, evaluation)
        if self.job_index >= 0 and self.partitions >= 1:
            self.replica, self.partition = divmod(self.job_index, self.partitions)
        if len(self.partition_addrs) == 1 and "{index}" in self.partition_addrs[0]:
            first = self.replica * self.partitions
            self.partition_addrs = [
                self.partition_addrs[0].replace("{index}", str(first + k))
                for k in range(self.partitions)
            ]
        if self.token_file:
            try:
                self.token = open(self.token_file).read().strip()  # noqa: SIM115 (one read)
            except OSError as exc:
                raise ValueError(f"token_file {self.token_file!r} cannot be read: {exc}") from None
            if not self.token:
                raise ValueError(f"token_file {self.token_file!r} holds no token")
        # A trainer only calls the others: loopback-only when everything it reaches is local.
        reached = [
            tokens.host_of(a)
            for a in (*self.controllers, *self.ps, *self.dataservers, *self.partition_addrs)
        ]
        self.token = tokens.resolve(self.token or default_token(), [self.host, *reached], "train")
        if not self.controllers and not self.ps:
            raise ValueError("give --controllers or --ps (parameter-server URLs)")
        if self.n_replicas < 1 or not 0 <= self.replica < self.n_replicas:
            raise ValueError(f"replica must be in 0..n_replicas-1, got {self.replica}")
        for name in ("epochs", "batch_size", "workers", "n_fetch", "n_push", "push_queue"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("lr", "local_lr"):  # the servers' sgd takes any lr: uphill is refused here
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 (as torch.optim), got {getattr(self, name)}")
        try:
            self.optimizer_spec()
        except OptimError as exc:  # names the bad kind or field and what is expected
            raise ValueError(f"optimizer: {exc}") from None
        if self.worker_mode not in ("process", "thread"):
            raise ValueError(f"worker_mode must be 'process' or 'thread', got {self.worker_mode!r}")
        if not 0.0 < self.epoch_fraction <= 1.0:
            raise ValueError("epoch_fraction must be in (0, 1]")
        if not re.fullmatch(r"[A-Za-z0-9_.\-]{0,64}", self.run):
            raise ValueError(
                f"run must be up to 64 letters, digits, '_', '.', '-', got {self.run!r}"
            )
        from adamps.core.stepclock import parse_mode

        if self.consistency:
            parse_mode(self.consistency)  # ValueError naming the value and what is expected
        if not self.torch:  # a bad --model is a message before anything starts
            from trainer.model import resolve_spec

            try:
                resolve_spec(self.model)
            except (ValueError, KeyError) as exc:
                raise ValueError(f"model {self.model[:200]!r}: {exc}") from None
        self.check_mode()
        if not self.compress_lr_scale > 0:
            raise ValueError(f"compress_lr_scale must be > 0, got {self.compress_lr_scale}")
        if not 0.0 < self.compress_fraction <= 1.0:
            raise ValueError(f"compress_fraction must be in (0, 1], got {self.compress_fraction}")
        if self.compress_coding not in ("words", "rice"):
            raise ValueError(
                f"compress_coding must be 'words' or 'rice', got {self.compress_coding!r}"
            )
        from adamps.compression.codec import parse_taus

        parse_taus(self.compress_tau)
        if not self.slowdown >= 1.0:
            raise ValueError(f"slowdown must be >= 1, got {self.slowdown}")
        if self.warm_start < 0:
            raise ValueError("warm_start must be >= 0")
        if self.partitions < 1:
            raise ValueError(f"partitions must be >= 1, got {self.partitions}")
        if self.torch and (self.partitions > 1 or self.coordinator):
            raise ValueError("--torch trains Downpour replicas: no --partitions, no --coordinator")
        if self.torch and not re.fullmatch(r"[\w.]+:[\w.]+", self.torch):
            raise ValueError(f"torch must be PKG.MODULE:FACTORY, got {self.torch!r}")
        if self.partitions > 1:
            from trainer.partition import check_partitions

            check_partitions(self.model, self.partitions)  # every layer gives each a unit
        if not -1 <= self.partition < self.partitions:
            raise ValueError(
                f"partition must be -1 or in 0..partitions-1 ({self.partitions}), "
                f"got {self.partition}"
            )
        if self.partition_transport not in ("auto", "shm", "tcp"):
            raise ValueError(
                f"partition_transport must be 'auto', 'shm' or 'tcp', got {self.partition_transport!r}"
            )
        if self.partition_addrs and len(self.partition_addrs) != self.partitions:
            raise ValueError(
                f"partition_addrs must name {self.partitions} host:port, got {self.partition_addrs}"
            )
        if self.partition >= 0 and self.partitions > 1 and not self.partition_addrs:
            raise ValueError("a single partition (--partition K) needs --partition-addrs")
