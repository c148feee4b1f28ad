"""The coordinator's configuration (TOML table ``[coordinator]``, env ``ADAMPS_COORDINATOR_<FIELD>``,
flags)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from adamps.config import default_token, field
from adamps.layout import DEFAULT_BUCKETS, MAX_SHARD_ELEMS
from adamps.security import token as tokens
from adamps.wire.web import HttpLimits


@dataclass
class CoordinatorConfig:
    host: str = field("127.0.0.1", help="address to listen on")
    port: int = field(7400, help="HTTP port (trainers ask here for portions)")
    token: str = field("", help="cluster token")
    controllers: list[str] = field(
        [],
        help="controller HTTP addresses (comma separated); Sandblaster needs replicated servers: "
        "a backup task's duplicate gradient is dropped by the servers' exactly-once table",
    )
    n_buckets: int = field(DEFAULT_BUCKETS, help="buckets of the layout (as the servers')")
    max_shard_elems: int = field(MAX_SHARD_ELEMS, help="largest shard (as the servers')")
    run: str = field(
        "sandblaster",
        help="name of the run: its record on the servers (sandblaster.<run>.state); a restarted "
        "coordinator with the same run resumes it",
    )
    model: str = field(
        "softmax-mnist",
        help="built-in model name (softmax-mnist, adam-mnist) or a JSON description",
    )
    source: str = field("builtin", help="training data every trainer loads (see adamps dataserver)")
    seed: int = field(0, help="seed of the initial weights")
    portions: int = field(40, help="portions per batch (many more than trainers)")
    backup: bool = field(True, help="schedule copies of outstanding portions at a batch's end")
    m: int = field(10, help="L-BFGS history size")
    max_iter: int = field(30, help="L-BFGS iterations")
    max_evals: int = field(20, help="evaluations per line search at most")
    gtol: float = field(1e-5, help="stop when the gradient norm is at most this")
    l2: float = field(1e-3, help="L2 regularization lam/2 ||w||^2 (applied by vector ops)")
    push_every: int = field(1, help="trainers send their gradients every this many portions")
    trainer_timeout: float = field(
        10.0, help="seconds of silence after which a trainer's portions go to others"
    )
    heldout: bool = field(
        False,
        help="measure each iterate's held-out accuracy (one pull of the model per iteration); "
        "in /status per_iteration and the history file",
    )
    history: str = field(
        "",
        help="append one JSON line per iteration (time, iteration, loss, heldout_accuracy) to "
        "this file (implies heldout); adamps up plots it",
    )
    exit_when_done: bool = field(
        False, help="exit once the run stopped (else keep serving /status until SIGTERM)"
    )
    max_body: int = field(1 << 20, help="largest request body in bytes")
    header_timeout: float = field(10.0, help="seconds for a complete request head")
    idle_timeout: float = field(30.0, help="seconds an idle keep-alive connection is kept")
    body_timeout: float = field(60.0, help="seconds a request body may take to arrive")
    max_connections: int = field(1024, help="open HTTP connections at most")
    log_level: str = field("INFO", help="logging level")

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.header_timeout, self.idle_timeout, self.body_timeout, self.max_connections
        )

    def __post_init__(self) -> None:
        reached = [tokens.host_of(a) for a in self.controllers]
        self.token = tokens.resolve(
            self.token or default_token(), [self.host, *reached], "coordinator"
        )
        if not self.controllers:
            raise ValueError("give --controllers (Sandblaster runs on replicated servers)")
        if not re.fullmatch(r"[A-Za-z0-9_\-]{1,64}", self.run):
            raise ValueError(f"run must be 1-64 letters, digits, '_', '-', got {self.run!r}")
        for name in ("portions", "m", "max_evals", "push_every", "n_buckets", "max_shard_elems"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_iter < 0 or self.l2 < 0 or self.gtol < 0:
            raise ValueError("max_iter, l2 and gtol must be >= 0")
        if not self.trainer_timeout > 0:
            raise ValueError(f"trainer_timeout must be > 0, got {self.trainer_timeout}")
