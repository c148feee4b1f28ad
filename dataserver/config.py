"""The data server's configuration (TOML table ``[dataserver]``, env ``ADAMPS_DATASERVER_<FIELD>``, flags)."""

from __future__ import annotations

from dataclasses import dataclass

from adamps.config import default_token, field
from adamps.security import token as tokens
from adamps.wire.web import HttpLimits


@dataclass
class DataServerConfig:
    host: str = field("127.0.0.1", help="address to listen on")
    port: int = field(7300, help="HTTP port")
    token: str = field("", help="cluster token required on /stream (Authorization: Bearer <token>)")
    controllers: list[str] = field(
        [],
        help="controllers (host:port, comma separated) whose runs' tokens may stream too "
        "('adamps run create'); none: the cluster token only",
    )
    source: str = field(
        "builtin",
        help="dataset: builtin | mnist:DIR | folder:DIR | npz:FILE | a path (kind guessed) | "
        "ctr (click logs of the planted-truth generator) | ctr:FILE (a Criteo-format TSV)",
    )
    ctr_examples: int = field(
        100_000, help="click logs: rows the 'ctr' generator draws (held-out ones included)"
    )
    ctr_id_space: int = field(
        1 << 20,
        help="click logs: a TSV's categorical values hash into ids 1 .. ctr_id_space-1 of their "
        "field (0: a missing value)",
    )
    holdout: float = field(
        0.2, help="held-out fraction per class for sources without their own test split"
    )
    color: bool = field(False, help="decode image folders as RGB instead of grayscale")
    slice_index: int = field(
        0,
        help="which slice of the dataset this server holds (the images whose index mod n_slices is slice_index)",
    )
    n_slices: int = field(1, help="number of slices the data servers split the dataset into")
    seed: int = field(
        1234, help="seed of the per-epoch order and augmentation (the same on every data server)"
    )
    augment: bool = field(True, help="augment training images (held-out images never are)")
    max_shift: float = field(2.0, help="largest random translation in pixels, per axis")
    max_rotation: float = field(15.0, help="largest random rotation in degrees")
    reflect: bool = field(False, help="random horizontal reflection (off for digits)")
    workers: int = field(
        1, help="augmentation worker processes (0: a thread in the server process)"
    )
    ahead: int = field(2, help="augmented epochs kept computed ahead of the newest requested one")
    chunk: int = field(1024, help="images per augmentation job")
    cache_bytes: int = field(
        1 << 30,
        help="memory bound of the image cache (decoded images + augmented epochs), or of a "
        "click log's rows, bytes",
    )
    heartbeat: float = field(
        1.0, help="seconds between 'wait' frames while a stream waits for its epoch's augmentation"
    )
    slice_size: int = field(
        256,
        help="elastic replicas: examples per leased slice of an epoch (a replica that dies "
        "mid-slice costs at most this many examples trained twice)",
    )
    slice_lease: float = field(
        10.0,
        help="elastic replicas: seconds a slice stays leased to a replica not heard from; "
        "then it goes to another replica and the replica stops counting as alive",
    )
    max_batch: int = field(4096, help="largest batch_size a stream may ask for")
    max_body: int = field(1 << 20, help="largest request body in bytes")
    header_timeout: float = field(
        10.0, help="seconds an HTTP connection has to send a complete request head"
    )
    idle_timeout: float = field(30.0, help="seconds an idle keep-alive HTTP connection is kept")
    body_timeout: float = field(120.0, help="seconds a request body may take to arrive")
    max_connections: int = field(
        1024, help="open HTTP connections; beyond, the oldest idle one is closed"
    )
    log_level: str = field("INFO", help="logging level")

    @property
    def http_limits(self) -> HttpLimits:
        return HttpLimits(
            self.header_timeout, self.idle_timeout, self.body_timeout, self.max_connections
        )

    def __post_init__(self) -> None:
        self.token = tokens.resolve(self.token or default_token(), [self.host], "dataserver")
        if self.n_slices < 1 or not 0 <= self.slice_index < self.n_slices:
            raise ValueError(
                f"slice_index {self.slice_index} must be in [0, n_slices={self.n_slices})"
            )
        if self.workers < 0 or self.ahead < 0 or self.chunk < 1 or self.max_batch < 1:
            raise ValueError("workers and ahead must be >= 0, chunk and max_batch >= 1")
        if self.slice_size < 1 or not self.slice_lease > 0:
            raise ValueError(
                f"slice_size must be >= 1 and slice_lease > 0, got {self.slice_size}, "
                f"{self.slice_lease}"
            )
        if self.heartbeat <= 0:
            raise ValueError("heartbeat must be > 0")
        if self.max_shift < 0 or self.max_rotation < 0:
            raise ValueError("max_shift and max_rotation must be >= 0")
