"""The replication shell: the asyncio side of adamps/core/replication/ (shell), its calls to the
controllers and to peers, the wire of batches, the re-checks, peer identity, metrics and the
copies on disk.

Imports: storage, store, updates, adamps/core/replication/; never api or the write path."""
