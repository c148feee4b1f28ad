"""The local-cluster tooling: ``adamps up`` (``main``) starts every role as a process on loopback
(``cluster``, ``procs``), with its flags (``flags``), its progress view (``view``) and plot
(``plot``); ``adamps launch`` (``launch``) starts N replicas of a script as torchrun does. The tests
start their clusters with the same code.

Imports: adamps.torch, adamps.client, adamps.security and the shared vocabulary; of the roles
only trainer.config (pyproject.toml, the contract "roles", says where and why).
"""
