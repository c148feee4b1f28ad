"""adamps: a Project Adam-style fault-tolerant parameter server."""

__version__ = "0.1.0"
