"""The client library: what a trainer or a tool needs to talk to a cluster.

``PSClient`` (``ps``) pulls and pushes, exactly once, over HTTP (``rpc``) or the binary data plane
(``dataplane``, ``pool``), splitting requests to the servers' limits (``parts``); ``rows`` does the
same for embedding tables; ``controller`` talks to the controllers; ``retry`` is the one retry
policy. Nothing here imports the servers or the local-cluster tooling (``adamps.up``).
"""

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
    "RoutingSource",
    "StaticRouting",
    "routing_from_table",
]
