"""PyTorch models on adamps: any ``torch.nn.Module`` as a Downpour replica (``pip install
'adamps[torch]'``). See docs/training.md.

- :class:`SGD`, :class:`Adagrad`, :class:`Adam`, :class:`AdamW`, :class:`RMSprop`: torch.optim
  optimizers whose rule the servers apply, one per param group, LR schedulers and GradScaler
  included (adamps/torch/server_optim.py);
- :class:`DownpourOptimizer`: the same, model first and the rule by name;
- :class:`Replica`: ``Replica(model, loss_fn, ...).fit(loader)`` with Hogwild worker threads;
- :class:`Embedding`, :class:`EmbeddingBag`: rows in a server table, pulled and pushed per batch;
- :class:`EmbeddingBagCollection`: every sparse feature of a keyed jagged batch
  (:class:`KeyedJaggedTensor`, or torchrec's) in one lookup, one request per server;
- :class:`Task`: what a ``--torch`` factory may return: a model, its loss, its own datasets, a
  held-out metric (adamps/torch/task.py);
- :func:`rank`, :func:`world_size`: this replica's place under ``adamps launch`` (or torchrun);
- :func:`tensor_name`: the server tensor of a parameter in a run (``RUN..PARAM``).
"""

from adamps.torch.collection import EmbeddingBagCollection, EmbeddingBagConfig
from adamps.torch.embedding import Embedding, EmbeddingBag
from adamps.torch.jagged import JaggedTensor, KeyedJaggedTensor, KeyedTensor
from adamps.torch.launch_env import rank, world_size
from adamps.torch.optimizer import Connection
from adamps.torch.params import ModelError, tensor_name
from adamps.torch.replica import Replica
from adamps.torch.server_optim import (
    SGD,
    Adagrad,
    Adam,
    AdamW,
    DownpourOptimizer,
    RMSprop,
    ServerOptimizer,
)
from adamps.torch.task import Task

__all__ = [
    "SGD",
    "Adagrad",
    "Adam",
    "AdamW",
    "Connection",
    "DownpourOptimizer",
    "Embedding",
    "EmbeddingBag",
    "EmbeddingBagCollection",
    "EmbeddingBagConfig",
    "JaggedTensor",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "ModelError",
    "RMSprop",
    "Replica",
    "ServerOptimizer",
    "Task",
    "rank",
    "tensor_name",
    "world_size",
]
