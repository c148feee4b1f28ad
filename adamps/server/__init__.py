"""The parameter server (`adamps ps`, Project Adam 3.3): what it answers (api/), the one write
path and the read path (writepath, reads, addressing), replication's shell (replication/), LMDB
(storage/), the store in memory (store/) and the update rules (updates/), each folder a layer of
the one below it (pyproject.toml, the contract "ps").

Imports: adamps.core, adamps.client (a server calls the controllers and its peers), adamps.wire,
adamps.security and the shared vocabulary; never adamps.up, adamps.torch or a role."""
