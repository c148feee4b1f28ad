"""Data servers (Project Adam 3.1): serve augmented, partitioned training batches to trainers."""
