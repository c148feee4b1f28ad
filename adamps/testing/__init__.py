"""Harnesses that tests and benchmarks share: the exact-sum checks (every acknowledged push present
exactly once), for dense tensors and for table rows.

Imports: adamps.client; nothing in adamps imports this folder."""
