"""Trainers: the numpy network engine, Hogwild workers and (later) Downpour SGD replicas."""
