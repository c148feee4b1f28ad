"""Data sets' formats that more than one role reads: what a source loads (``dataset``: a
`Dataset`, or a `SourceError`), click logs' rows (``clicks``, Criteo's format) and the planted
click-through workload (``ctr_data``). The data servers serve them (dataserver/), `adamps up
--torch` checks a model on their first rows (adamps.torch.data), the CTR workloads train on the
planted one.

Imports: adamps.tables only; nothing of the roles, the wire, the client or the servers.
"""
