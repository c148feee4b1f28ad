"""Embedding tables' rows in memory: row blocks and their index, the deltas and pages they are
persisted as, the frequency sketch of admission.

Imports: the store's shards, updates; never the store's Store."""
