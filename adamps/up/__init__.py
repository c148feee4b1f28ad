"""The local-cluster tooling: ``adamps up`` (``main``) starts every role as a process on loopback
(``cluster``, ``procs``), with its flags (``flags``) and its progress view (``view``). The tests
start their clusters with the same code.
"""
