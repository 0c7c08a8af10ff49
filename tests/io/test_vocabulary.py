"""A union vocabulary's rows built on read: each model's own rows, and mergekit's default rows where it lacks a token
(hand-computed values)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.io.safetensors_io import RowReader
from ram_trl.io.vocabulary import UnionRows, is_vocabulary_tensor, pad_vocabularies

HIDDEN = 2


def _model(path, rows, offset, dtype=torch.float32):
    """Embedding row ``i`` is ``[offset + i, -(offset + i)]``; a norm that is not a vocabulary tensor."""
    path.mkdir()
    values = torch.arange(rows, dtype=torch.float32) + offset
    save_file(
        {
            "model.embed_tokens.weight": torch.stack([values, -values], dim=1).to(dtype),
            "model.norm.weight": torch.full((HIDDEN,), float(offset)),
        },
        str(path / "model.safetensors"),
    )
    return open_checkpoint(path, path.name)


def test_rows_a_model_lacks_come_from_the_base_the_only_holder_or_the_holders_mean(tmp_path):
    base = _model(tmp_path / "base", 3, 0)  # tokens 0-2
    a = _model(tmp_path / "a", 5, 100)  # adds 3 and 4
    b = _model(tmp_path / "b", 4, 200)  # adds 3
    # token 3: a and b have it (their mean); token 4: a alone
    union = UnionRows(5, {3: (1, 2), 4: (1,)})
    padded = pad_vocabularies(base, [a, b], union)
    name = "model.embed_tokens.weight"
    with RowReader() as reader:
        rows = [m.read_rows(name, reader)[:, 0].tolist() for m in padded]
        assert rows[0] == [0, 1, 2, (103 + 203) / 2, 104]
        assert rows[1] == [100, 101, 102, 103, 104]
        assert rows[2] == [200, 201, 202, 203, 104]
        assert padded[2].read_rows(name, reader, 3, 5)[:, 1].tolist() == [-203, -104]
        assert padded[0].read_rows("model.norm.weight", reader).tolist() == [0.0, 0.0]
    assert all(m.tensors[name].shape == (5, HIDDEN) for m in padded)
    assert padded[0].location(name) is None and padded[0].location("model.norm.weight") is not None
    # b lacks token 1, which only the base has; then b lacks token 2, which the base and a have: the base's row
    padded = pad_vocabularies(base, [b], UnionRows(4, {1: (0,), 3: (1,)}))
    with RowReader() as reader:
        assert padded[1].read_rows(name, reader)[:, 0].tolist() == [200, 1, 202, 203]
    padded = pad_vocabularies(base, [a, b], UnionRows(5, {2: (0, 1), 3: (1, 2), 4: (1,)}))
    with RowReader() as reader:
        assert padded[2].read_rows(name, reader, 2, 3)[:, 0].tolist() == [2]


def test_the_mean_is_taken_in_the_load_dtype(tmp_path):
    base = _model(tmp_path / "base", 1, 0)
    a = _model(tmp_path / "a", 2, 0.5)  # row 1: 1.5
    b = _model(tmp_path / "b", 2, 1.0 + 2**-9)  # row 1: 2 + 2**-9, which bfloat16 rounds to 2
    name = "model.embed_tokens.weight"
    with RowReader() as reader:
        exact = pad_vocabularies(base, [a, b], UnionRows(2, {1: (1, 2)}))[0].read_rows(name, reader)
        rounded = pad_vocabularies(base, [a, b], UnionRows(2, {1: (1, 2)}, torch.bfloat16))[0]
        assert exact[1, 0].item() == (1.5 + 2 + 2**-9) / 2
        assert rounded.read_rows(name, reader)[1, 0].item() == 1.75


def test_vocabulary_tensors_in_several_dtypes_are_refused(tmp_path):
    base = _model(tmp_path / "base", 1, 0)
    a = _model(tmp_path / "a", 2, 0, dtype=torch.bfloat16)
    with pytest.raises(CheckpointError, match="model.embed_tokens.weight.*in every model in one dtype"):
        pad_vocabularies(base, [a], UnionRows(2, {1: (1,)}))


def test_token_rules_replace_the_default_and_force_every_model(tmp_path):
    base = _model(tmp_path / "base", 3, 0)
    a = _model(tmp_path / "a", 5, 100)
    b = _model(tmp_path / "b", 5, 200)
    # token 3: base lacks it, rule: zero; token 4: base lacks it, rule: b's row 1; token 1: forced to a's row 2
    union = UnionRows(
        5,
        {3: (1, 2), 4: (1, 2)},
        sources={3: ("zero",), 4: ("model", 2, 1), 1: ("model", 1, 2)},
        forced=frozenset({1}),
    )
    assert union.rebuilt(0) == [1, 3, 4] and union.rebuilt(1) == [1]
    padded = pad_vocabularies(base, [a, b], union)
    with RowReader() as reader:
        rows = [m.read_rows("model.embed_tokens.weight", reader)[:, 0].tolist() for m in padded]
    assert rows == [[0, 102, 2, 0, 201], [100, 102, 102, 103, 104], [200, 102, 202, 203, 204]]


def test_padding_rows_are_the_mean_of_each_models_union_rows(tmp_path):
    base = _model(tmp_path / "base", 2, 0)
    a = _model(tmp_path / "a", 3, 10)
    padded = pad_vocabularies(base, [a], UnionRows(3, {2: (1,)}, padded_rows=5))
    with RowReader() as reader:
        rows = [m.read_rows("model.embed_tokens.weight", reader)[:, 0].tolist() for m in padded]
        # base: 0, 1 and a's 12, padded with their mean; a: 10, 11, 12 and their mean
        third = torch.tensor(13 / 3).item()  # float32
        assert rows == [[0, 1, 12, third, third], [10, 11, 12, 11, 11]]
        assert padded[0].read_rows("model.embed_tokens.weight", reader, 1, 4)[:, 0].tolist() == [1, 12, third]
    assert padded[1].tensors["model.embed_tokens.weight"].shape == (5, HIDDEN)


@pytest.mark.parametrize(
    ("name", "vocabulary"),
    [
        ("model.embed_tokens.weight", True),
        ("lm_head.weight", True),
        ("transformer.wte.weight", True),
        ("shared.weight", True),
        ("base_model.model.lm_head.lora_B.weight", True),
        ("model.embed_positions.weight", False),
        ("model.layers.0.mlp.up_proj.weight", False),
        ("model.norm.weight", False),
    ],
)
def test_vocabulary_tensors(name, vocabulary):
    assert is_vocabulary_tensor(name) is vocabulary
