"""What a parameter server answers: the HTTP app, the binary data plane, the ops (round, tables,
vectors, clocks, checkpoints) and who a request is (tenancy).

Imports: the write and read paths (adamps/server/writepath.py, reads.py), replication, storage,
store and updates; nothing imports it but adamps/server/main.py."""
