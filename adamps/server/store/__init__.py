"""The parameter store in memory: shards, each mutated by one owner thread, their records and
checksums, initial values, tickets of queued work, and the tables' row blocks (tables/).

Imports: updates; never storage, replication or api."""
