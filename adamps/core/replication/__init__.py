"""Replication as pure state machines (Project Adam 3.3.3): one bucket over two-phase commit
(bucket), one server's core of every bucket and decision (node) and its parts; no IO, no clock.

Imports: adamps/core/lease.py only; the server's shell (adamps/server/replication/) carries out
what it decides."""
