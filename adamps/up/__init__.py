"""The local-cluster tooling: ``adamps up`` (``main``) starts every role as a process on loopback
(``cluster``, ``procs``), with its flags (``flags``), its progress view (``view``) and plot
(``plot``); ``adamps launch`` (``launch``) starts N replicas of a script as torchrun does. The tests
start their clusters with the same code. ``train_flags``: `adamps train`'s flags as data, which
`adamps up` checks each ``--train-arg`` against and the trainers' configuration is made of.

Imports: adamps.torch, adamps.client, adamps.security and the shared vocabulary; none of the
roles (they import adamps, never the other way round).
"""
