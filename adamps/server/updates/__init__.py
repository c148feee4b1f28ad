"""How an update changes a tensor: the optimizers and their kernels, per-push hyperparameters,
compressed pushes, bounds that keep floats finite, vector ops, checkpoint installs.

Imports: adamps.optspec, adamps.blas, adamps.compression, adamps.wire; nothing else of the
server."""
