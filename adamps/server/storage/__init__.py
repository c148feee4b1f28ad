"""LMDB: the tensor catalog, shards' records persisted and reloaded, the flusher and its times, the
scrub, giving freed memory back.

Imports: store and updates; never replication or api."""
