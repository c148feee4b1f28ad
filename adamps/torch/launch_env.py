"""What ``adamps.torch`` takes from its environment when the script does not say: the cluster
(``adamps launch``, ``adamps up --detach``: adamps.clusters' rule), the run name and the
replica's rank, as a torchrun script takes them from torchrun's variables.

    sampler = DistributedSampler(dataset, num_replicas=adamps.torch.world_size(),
                                 rank=adamps.torch.rank())

``DistributedSampler`` without these arguments asks ``torch.distributed`` for an initialized
process group; Downpour replicas need none (they meet only on the servers), so pass them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from adamps import clusters
from adamps.client.controller import ControllerClient
from adamps.security import token as tokens


def rank() -> int:
    """This replica's rank: ``$RANK`` (set by ``adamps launch`` and torchrun), else 0."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """The number of replicas: ``$WORLD_SIZE``, else 1."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def connection_defaults(
    controllers: Sequence[str], ps: Sequence[str], run: str | None, token: str | None
) -> tuple[list[str], str | None, str]:
    """(controllers, run, token) of a Connection: those given, else the environment's. The
    token, as every role's: given, $ADAMPS_TOKEN, $ADAMPS_TOKEN_FILE, the cluster's token file,
    else (loopback only) this user's local token."""
    if run is None:
        run = os.environ.get("ADAMPS_RUN") or None
    if ps and not controllers:  # standalone servers: no cluster to look up
        reached = [tokens.host_of(a) for a in ps]
        return [], run, tokens.resolve(token or os.environ.get("ADAMPS_TOKEN", ""), reached,
                                       "adamps.torch")  # fmt: skip
    has_env = os.environ.get("ADAMPS_CONTROLLERS") or os.environ.get("ADAMPS_CLUSTER")
    if (
        not controllers
        and not has_env
        and not clusters.cluster_file(clusters.DEFAULT_NAME).exists()
    ):
        return [], run, token or ""  # nothing to find: RemoteModel says what to give
    target = clusters.resolve(",".join(controllers), token, None, "adamps.torch")
    return target.controllers, run, target.token


def publish_layout(controllers: Sequence[str], token: str, layout: Any, run: str | None) -> None:
    """Stores the model's layout (its run's part) at the controllers, as `adamps train`'s replica
    0 does: GET /layout and `adamps status --run` then show the run's tensors and buckets, and
    a run's element quota is checked against them."""
    client = ControllerClient(list(controllers), token, timeout=10.0, retry_for=30.0)
    try:
        client.set_layout(layout.to_dict(), run=run)
    finally:
        client.close()
