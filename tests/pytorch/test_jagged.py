"""Keyed jagged batches and keyed pooled rows (adamps/torch/jagged.py) and the checks of an
EmbeddingBagCollection's configuration (issue 38 item 4): no server involved."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="adamps.torch needs torch")

import adamps.torch as at  # noqa: E402
from adamps.torch.jagged import features  # noqa: E402

C = at.EmbeddingBagConfig


def test_lengths_and_offsets_give_the_same_batch() -> None:
    values = torch.tensor([7, 1, 2, 3, 4])
    by_len = at.KeyedJaggedTensor(["user", "item"], values, lengths=torch.tensor([1, 1, 3, 0]))
    by_off = at.KeyedJaggedTensor.from_offsets_sync(
        ["user", "item"], values, torch.tensor([0, 1, 2, 5, 5])
    )
    for kjt in (by_len, by_off):
        assert kjt.stride() == 2 and kjt.length_per_key() == [2, 3]
        assert kjt.lengths().tolist() == [1, 1, 3, 0]
        assert kjt.offsets().tolist() == [0, 1, 2, 5, 5]
        d = kjt.to_dict()
        assert d["item"].values().tolist() == [2, 3, 4]
        assert d["item"].lengths().tolist() == [3, 0]
        assert d["item"].offsets().tolist() == [0, 3, 3]
        assert kjt.weights_or_none() is None


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lengths": torch.tensor([1, 1, 1, 1])}, "sum to 4 ids, but values holds 5"),
        ({"lengths": torch.tensor([1, 1, 3])}, "do not split into 2 keys"),
        ({"lengths": torch.tensor([1, 1, 3, 0]), "offsets": torch.tensor([0])}, "one of them"),
        ({"lengths": torch.tensor([1, 1, 3, 0]), "weights": torch.ones(2)}, "one per id"),
        ({"offsets": torch.tensor([1, 2, 5, 5, 5])}, "start at 0"),
    ],
)
def test_a_batch_that_does_not_fit_is_named(kwargs, match) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=match):
        at.KeyedJaggedTensor(["user", "item"], torch.tensor([7, 1, 2, 3, 4]), **kwargs)


class OffsetsOnly:
    """A keyed jagged batch seen only through torchrec's method names, without lengths()."""

    def keys(self) -> list[str]:
        return ["a", "b"]

    def values(self) -> torch.Tensor:
        return torch.tensor([5, 6, 7])

    def offsets(self) -> torch.Tensor:
        return torch.tensor([0, 2, 2, 3, 3])

    def weights_or_none(self) -> torch.Tensor:
        return torch.tensor([0.5, 1.0, 2.0])


def test_any_object_with_torchrecs_methods_is_read() -> None:
    got = features(OffsetsOnly(), ["b", "a"])
    assert list(got) == ["b", "a"]
    ids, lengths, w = got["a"]
    assert ids.tolist() == [5, 6] and lengths.tolist() == [2, 0] and w.tolist() == [0.5, 1.0]
    assert got["b"][0].tolist() == [7] and got["b"][1].tolist() == [1, 0]
    with pytest.raises(KeyError, match="'c' is not in the batch's keys"):
        features(OffsetsOnly(), ["c"])
    with pytest.raises(TypeError, match="KeyedJaggedTensor"):
        features(torch.tensor([1]), ["a"])


def test_keyed_tensor_splits_by_key() -> None:
    kt = at.KeyedTensor(["a", "b"], [2, 3], torch.arange(10.0).reshape(2, 5))
    assert kt.offset_per_key() == [0, 2, 5]
    assert kt["b"].tolist() == [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]
    assert list(kt.to_dict()) == ["a", "b"]
    with pytest.raises(ValueError, match="one length per key"):
        at.KeyedTensor(["a"], [4], torch.zeros(2, 5))


def test_a_collections_configuration_is_checked() -> None:
    with pytest.raises(at.ModelError, match="feature 'f' is in tables 't' and 'u'"):
        at.EmbeddingBagCollection([C(None, 4, "t", ["f"]), C(None, 4, "u", ["f"])])
    with pytest.raises(at.ModelError, match="distinct name"):
        at.EmbeddingBagCollection([C(None, 4, "t", ["f"]), C(None, 4, "t", ["g"])])
    with pytest.raises(at.ModelError, match="pooled by sum"):
        at.EmbeddingBagCollection([C(None, 4, "t", ["f"], pooling="mean")], is_weighted=True)
    with pytest.raises(at.ModelError, match="pooling must be"):
        at.EmbeddingBagCollection([C(None, 4, "t", ["f"], pooling="max")])
    with pytest.raises(at.ModelError, match="no feature_names"):
        at.EmbeddingBagCollection([C(None, 4, "t")])

    class PoolingType:  # torchrec's enum, by its value
        value = "MEAN"

    ebc = at.EmbeddingBagCollection(
        [C(None, 4, "t", ["f", "g"], pooling=PoolingType()), C(10, 2, "u", ["h"], padding_idx=0)]
    )
    assert ebc.feature_names() == ["f", "g", "h"] and not ebc.is_weighted()
    assert [c.name for c in ebc.embedding_bag_configs()] == ["t", "u"]
    assert ebc.embedding_bags["t"].mode == "mean"
    assert ebc.embedding_bags["u"].padding_idx == 0
    kjt = at.KeyedJaggedTensor(["f", "g"], torch.tensor([1]), lengths=torch.tensor([1, 0]))
    with pytest.raises(KeyError, match="'h' is not in the batch's keys"):
        ebc(kjt)
    full = at.KeyedJaggedTensor(["f", "g", "h"], torch.tensor([1]), lengths=torch.tensor([1, 0, 0]))
    with pytest.raises(RuntimeError, match="not bound"):
        ebc(full)


def test_the_one_batch_check_runs_a_collection() -> None:
    """`adamps up --torch`'s one-batch check (no server) runs a model with a collection: its
    stand-in tables answer the collection's round, and it leaves the tables unbound."""
    from torch import nn

    from adamps.torch.task import Task, check_task

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ebc = at.EmbeddingBagCollection([C(None, 4, "t", ["f", "g"])])
            self.head = nn.Linear(8, 1)

        def forward(self, kjt: at.KeyedJaggedTensor) -> torch.Tensor:
            return self.head(self.ebc(kjt).values()).squeeze(1)

    model = Net()
    kjt = at.KeyedJaggedTensor(
        ["f", "g"], torch.tensor([1, 2, 3]), lengths=torch.tensor([1, 1, 0, 1])
    )
    loss = nn.functional.binary_cross_entropy_with_logits
    check_task(Task(model, loss=loss), "test:net", (kjt, torch.tensor([1.0, 0.0])), None)
    assert model.ebc.embedding_bags["t"].server_table is None
