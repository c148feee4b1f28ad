"""The client library: what a trainer or a tool needs to talk to a cluster.

``PSClient`` (``ps``) pulls and pushes, exactly once, over HTTP (``rpc``) or the binary data plane
(``dataplane``, ``pool``), splitting requests to the servers' limits (``parts``); ``rows`` does the
same for embedding tables; a push is checked whole before any part is sent (``push_checks``)
and a push applied in part says which parts (``partial``); ``controller`` talks to the controllers; ``retry`` is the one retry
policy. Nothing here imports the servers or the local-cluster tooling (``adamps.up``).
"""

from adamps.client.partial import PartialPushError
from adamps.client.ps import (
    RETRYABLE,
    ControllerRouting,
    PSClient,
    RoutingSource,
    StaticRouting,
    routing_from_table,
)

__all__ = [
    "RETRYABLE",
    "ControllerRouting",
    "PSClient",
    "PartialPushError",
    "RoutingSource",
    "StaticRouting",
    "routing_from_table",
]
