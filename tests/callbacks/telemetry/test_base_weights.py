"""Where the telemetry reads base weights from (:mod:`ram_trl.callbacks.telemetry.base_weights`): the three sources serve the
same element ranges and fingerprint as the checkpoint on disk; bad requests name the source; names of wrapped
training parameters map to checkpoint names."""

from __future__ import annotations

import pytest
import torch

from ram_trl.callbacks.telemetry.base_weights import (
    MappedCheckpointBase,
    ModelBase,
    SnapshotBase,
    base_name,
    source_fingerprint,
)
from ram_trl.callbacks.telemetry.shards import LocalShard
from ram_trl.errors import CheckpointError
from ram_trl.stage.manifest import fingerprint_checkpoint
from tests.helpers import EMBED, UP, base_tensors, save_checkpoint


def shards(tensors: dict[str, torch.Tensor]) -> dict[str, LocalShard]:
    return {n: LocalShard(n, t.reshape(-1), tuple(t.shape), 0, False) for n, t in tensors.items()}


def test_base_names_of_wrapped_parameters():
    cases = {
        "module.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": (
            "model.layers.0.self_attn.q_proj.weight"
        ),
        "base_model.model.lm_head.modules_to_save.default.weight": "lm_head.weight",
        "base_model.model.lm_head.original_module.weight": "lm_head.weight",
        "_orig_mod.model.layers.1._fsdp_wrapped_module.mlp.up_proj.weight": "model.layers.1.mlp.up_proj.weight",
        "model.norm.weight": "model.norm.weight",
        "model.module.weight": "model.module.weight",
    }
    for name, expected in cases.items():
        assert base_name(name) == expected


def test_sources_serve_the_checkpoints_elements_and_fingerprint(tmp_path):
    tensors = base_tensors()
    path = save_checkpoint(tmp_path / "base", tensors)
    mapped = MappedCheckpointBase(path)
    in_memory = ModelBase(shards(tensors), "reference model")
    snapshot = SnapshotBase(shards(tensors))
    try:
        for source in (mapped, in_memory, snapshot):
            assert sorted(source.names()) == sorted(tensors)
            for name, value in tensors.items():
                assert source.shape(name) == tuple(value.shape)
                flat = value.reshape(-1)
                assert torch.equal(source.read(name, 3, 5), flat[3:8])
            assert source_fingerprint(source) == fingerprint_checkpoint(path)
        assert mapped.nbytes == in_memory.nbytes == 0
        assert snapshot.nbytes == sum(t.numel() * 4 for t in tensors.values())
    finally:
        mapped.close()


def test_snapshot_is_a_copy(tmp_path):
    tensors = base_tensors()
    snapshot = SnapshotBase(shards(tensors))
    before = tensors[UP].reshape(-1)[:4].clone()
    tensors[UP].add_(1.0)  # training moves the parameters; the snapshot keeps the base
    assert torch.equal(snapshot.read(UP, 0, 4), before)
    assert snapshot.description == "in-memory snapshot taken at train begin"


def test_bad_requests_name_the_source(tmp_path):
    tensors = base_tensors()
    mapped = MappedCheckpointBase(save_checkpoint(tmp_path / "base", tensors))
    numel = tensors[EMBED].numel()
    with pytest.raises(CheckpointError, match=rf"tensor '{EMBED}' has {numel} elements, elements \[{numel - 1}, "):
        mapped.read(EMBED, numel - 1, 2)
    with pytest.raises(CheckpointError, match="has no tensor 'nope'"):
        mapped.read("nope", 0, 1)
    partial = {UP: LocalShard(UP, tensors[UP].reshape(-1)[:10], tuple(tensors[UP].shape), 0, True)}
    with pytest.raises(CheckpointError, match=r"reference model: holds elements \[0, 10\) .* partitioned differently"):
        ModelBase(partial, "reference model").read(UP, 8, 4)
    with pytest.raises(CheckpointError, match="reference model: has no parameter 'nope'"):
        ModelBase(partial, "reference model").read("nope", 0, 1)


def test_only_full_safetensors_checkpoints_are_mapped(tmp_path):
    path = tmp_path / "pickled"
    path.mkdir()
    torch.save(base_tensors(), path / "pytorch_model.bin")
    (path / "config.json").write_text('{"model_type": "llama"}')
    refused = "is a pickle checkpoint; the telemetry reads the base from a full"
    with pytest.warns(UserWarning, match="loading pickle checkpoint"), pytest.raises(CheckpointError, match=refused):
        MappedCheckpointBase(path)
