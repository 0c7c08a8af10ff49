"""``ram_trl.io.model_dir``: a directory two readers would read as two models is refused by every reader."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.errors import CheckpointError
from ram_trl.evaluation.fisher import load_agent
from ram_trl.io.checkpoint import open_checkpoint


def _full(path, shards: bool = False):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text('{"model_type": "llama"}')
    save_file({"w": torch.zeros(2)}, str(path / "model.safetensors"))
    if shards:
        save_file({"w": torch.ones(2)}, str(path / "model-00001-of-00001.safetensors"))
        index = {"weight_map": {"w": "model-00001-of-00001.safetensors"}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    return path


def _readers(path):
    yield lambda: open_checkpoint(path, "agent 'coding'")  # merge, analyze, preview
    yield lambda: load_agent(path)  # eval, fisher, the recipes' scoring


def test_a_single_file_beside_a_stale_shard_index_is_refused_by_every_reader(tmp_path):
    path = _full(tmp_path / "agent", shards=True)
    for read in _readers(path):
        with pytest.raises(CheckpointError) as exc:
            read()
        message = str(exc.value)
        assert "\n" not in message and str(path) in message, message
        assert "model.safetensors and a shard index" in message and "remove the stale one" in message, message


def test_a_full_model_beside_an_adapter_is_refused_by_every_reader(tmp_path):
    path = _full(tmp_path / "agent")
    (path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 1, "lora_alpha": 1}')
    for read in _readers(path):
        with pytest.raises(CheckpointError, match=r"both a full model \(model.safetensors\) and a PEFT adapter"):
            read()


def test_one_model_per_directory_is_read(tmp_path):
    assert open_checkpoint(_full(tmp_path / "agent"), "agent").tensors["w"].shape == (2,)
