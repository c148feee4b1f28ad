"""Pure cores, with no IO and no clock (etcd-io/raft's shape): replication (replication/), leases
(lease), runs' step clocks (stepclock), why a flush is slow (flush_stall), the lr of an async
replica's stale push (staleness). Time enters as an
argument; the servers' and controllers' shells carry out what they decide.

Imports: nothing of adamps outside this folder."""
