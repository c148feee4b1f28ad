"""`adamps train`'s flags as data: each field's name, type, default and help. The trainers'
configuration (trainer/config.py, ``TrainConfig``) is this class with its checks; `adamps up`
checks each ``--train-arg`` against these fields before it starts any process. Here, and not in
trainer/, so that adamps imports none of the roles (pyproject.toml, the contract "roles")."""

from __future__ import annotations

from dataclasses import dataclass

from adamps.config import field


@dataclass
class TrainFlags:
    controllers: list[str] = field(
        [],
        help="controller HTTP addresses (host:port, comma separated): routing table, layout and "
        "epoch progress come from them; empty = static mode with --ps",
    )
    ps: list[str] = field(
        [],
        help="parameter-server URLs of a static bucket map (comma separated); used when no "
        "controllers are given (progress is then kept in a small board tensor on the servers)",
    )
    dataservers: list[str] = field(
        ["http://127.0.0.1:7300"], help="data-server URLs (comma separated; copies fail over)"
    )
    token: str = field("", help="cluster token (or a run's token: see --token-file)")
    token_file: str = field(
        "",
        help="read the token from this file: a run's token (`adamps run create NAME "
        "--token-file F`), which reads and writes only the run's namespace NAME..",
    )
    replica: int = field(
        -1,
        minimum=-1,
        help="index of this model replica, 0 .. n_replicas-1; not given (-1) with --run: an "
        "elastic replica that joins the run and trains the slices the data server leases it "
        "(docs/training.md); not given without --run: 0",
    )
    n_replicas: int = field(1, help="number of model replicas training together")
    run: str = field(
        "",
        help="name of the training run (letters, digits, '_', '.', '-'; a run made with `adamps "
        "run create`, which has its own namespace, token and quotas, has no '.'): replicas of one "
        "run share a progress board; a new name starts a new run on servers that keep an old one's",
    )
    consistency: str = field(
        "",
        help="consistency mode of the run, enforced by the parameter servers from the replicas' "
        "step clocks: 'async' (Downpour), 'ssp:S' (no replica more than S steps ahead of the "
        "slowest live one) or 'sync' (every live replica's step t summed before any fetches "
        "step t+1); ssp and sync step once per round (use --workers 1 --n-push 1 for a step "
        "of one minibatch). Empty: the mode of the run's record (`adamps run create NAME "
        "--consistency MODE`), else async; a mode given here that differs from the record is "
        "refused",
    )
    model: str = field("adam-mnist", help="built-in model name or a JSON model description")
    torch: str = field(
        "",
        help="train a PyTorch model instead (extra adamps[torch]): PKG.MODULE:FACTORY, a callable "
        "returning a torch.nn.Module (e.g. examples.torch_mnist:Net); --out then gets a state_dict",
    )
    seed: int = field(0, help="seed of the initial weights (replica 0 creates the tensors)")
    epochs: int = field(5, help="training epochs (1-based epoch numbers 1..epochs)")
    batch_size: int = field(8, help="images per minibatch (one worker step)")
    workers: int = field(1, help="Hogwild workers sharing this replica's weights without locks")
    worker_mode: str = field(
        "process", help="Hogwild workers: 'process' (shared memory, default) or 'thread'"
    )
    n_fetch: int = field(
        8,
        help="fetch the parameters every n_fetch minibatches per worker (rounded up to whole "
        "rounds; DistBelief 4.1)",
    )
    n_push: int = field(
        4,
        help="minibatches each worker trains per round; the round's updates are pushed after it "
        "(so the replica pushes every n_push * workers steps)",
    )
    optimizer: str = field(
        "adagrad",
        help="server-side optimizer of every tensor, torch.optim's names and rules: 'adagrad', "
        "'sgd', 'adam', 'adamw', 'rmsprop'; or 'adagrad_legacy' (adamps' Adagrad before torch's "
        "rule); docs/training.md, 'Optimizers'",
    )
    lr: float = field(0.01, help="server-side learning rate (of the optimizer above)")
    adagrad_initial: float = field(
        0.0,
        help="Adagrad's initial accumulator (torch's initial_accumulator_value, default 0: the "
        "first step is then lr * sign(gradient))",
    )
    optimizer_args: str = field(
        "",
        help="the optimizer's other hyperparameters as a JSON object with torch.optim's names, "
        'e.g. \'{"momentum": 0.9, "nesterov": true}\' or \'{"betas": [0.9, 0.99]}\'',
    )
    local_lr: float = field(
        0.03, help="learning rate of the plain SGD steps on the replica's local copy"
    )
    warm_start: int = field(
        100,
        help="warm start (DistBelief 4.1): replica 0 trains this many minibatches alone before "
        "the other replicas start",
    )
    epoch_fraction: float = field(
        0.75,
        help="an epoch is complete when this fraction of the replicas finished it (Adam 3.2.5); "
        "a replica still inside a completed epoch moves on to the next",
    )
    push_queue: int = field(
        4, help="pushes queued for the push thread; beyond, new updates are merged into the last"
    )
    http_only: bool = field(
        False,
        help="pull and push over HTTP only, even where a parameter server offers its binary "
        "data port (default: the data port where offered, HTTP elsewhere)",
    )
    fuse_tensors: bool = field(
        False,
        help="numpy engine: pack the model's small layers into placement groups of at most "
        "one shard (tensor fusion: a round touches a few buckets, not one per tensor; names "
        "RUN..{G}LAYER.w). adamps.torch always packs (fuse=False on its optimizers)",
    )
    compress: bool = field(
        False,
        help="push Strom's threshold-quantized updates with error feedback (a residual per "
        "tensor; +-tau per sent element) instead of dense deltas where that is smaller",
    )
    compress_fraction: float = field(
        0.01,
        help="compression: adaptive tau, the fraction of a tensor's elements sent per push "
        "(tensors without a fixed --compress-tau)",
    )
    compress_tau: list[str] = field(
        [],
        help="compression: fixed thresholds, TAU for every tensor or TENSOR=TAU (comma "
        "separated; gradient units); tensors not named use --compress-fraction",
    )
    compress_coding: str = field(
        "rice",
        help="compression: 'words' (32-bit word per sent element: 31-bit index, sign) or "
        "'rice' (Golomb-Rice coded index gaps, about 10 bits per element)",
    )
    compress_lr_scale: float = field(
        2.0,
        help="compression with server-side Adagrad: the tensors' lr is lr x this (Adagrad takes "
        "one normalized step per +-tau update, which stands for the gradient of several pushes; "
        "2 matched the uncompressed accuracy of adam-mnist, docs/benchmarks.md); SGD: unused",
    )
    out: str = field("", help="replica 0 writes the final weights here (.npz); empty = not saved")
    init: str = field(
        "",
        help="warm start: replica 0 takes the initial weights from this checkpoint directory "
        "(adamps checkpoint save) or .npz instead of --seed; empty = random by --seed",
    )
    history: str = field(
        "", help="JSON-lines file of per-epoch {time, epoch, loss, accuracy, images_per_s}"
    )
    host: str = field("127.0.0.1", help="address of the trainer's /metrics, /status, /healthz")
    metrics_port: int = field(
        0, help="port of /metrics, /status, /healthz (0: any free; -1: off)", minimum=-1
    )
    progress_interval: float = field(
        0.5, help="seconds between progress reports to (and epoch checks at) the board"
    )
    wait_timeout: float = field(
        600.0, help="seconds to wait for replica 0 (tensors, warm start) before giving up"
    )
    coordinator: str = field(
        "",
        help="Sandblaster L-BFGS: the coordinator's URL; this trainer then computes the portions "
        "it hands out (trainer/sandblaster.py) instead of running Downpour",
    )
    slowdown: float = field(
        1.0,
        help="test flag: make a Sandblaster trainer, or a replica under --consistency ssp/sync, "
        "this many times slower",
    )
    log_level: str = field("INFO", help="logging level")
    # Model parallelism (issue 15, trainer/partitioned.py): one replica as K processes.
    partitions: int = field(
        1, help="processes (maybe machines) one replica is cut into, each a vertical slice"
    )
    partition: int = field(
        -1,
        minimum=-1,
        help="this process's partition 0..partitions-1; -1 = start all of them here as child "
        "processes and restart the replica when one dies",
    )
    partition_addrs: list[str] = field(
        [],
        help="host:port of every partition (comma separated, in order): port = partition 0's "
        "control link, port+1+w = worker w's exchange; empty = free loopback ports",
    )
    job_index: int = field(
        -1,
        minimum=-1,
        help="this pod's index in a Kubernetes Indexed Job of n_replicas x partitions pods: "
        "sets replica = index // partitions and partition = index % partitions; a single "
        "--partition-addrs entry with '{index}' then names every partition of the replica",
    )
    partition_transport: str = field(
        "auto",
        help="exchange between partitions: 'shm' (shared memory, one machine), 'tcp', or 'auto' "
        "(shm when every partition address is the same host)",
    )
    partition_restarts: int = field(
        3, help="times the launcher (--partition -1) restarts a replica whose partition died"
    )
