"""Who may talk to whom: the cluster and run tokens, TLS (and `adamps up --tls`'s throwaway CA),
the servers' pairwise peer keys.

Imports: adamps.config, adamps.runs; nothing of the wire, the client or the servers."""
