"""A MODEL+ADAPTER made a full model: PEFT's merge_and_unload, written once and reused."""

from __future__ import annotations

import tempfile

import torch
from safetensors.torch import load_file

from ram_trl.io.lora_base import CACHE_NAME, merged_model
from tests.helpers import lora_adapter, qwen_model, save_base


def test_the_merged_model_is_peft_merge_and_unload_and_is_reused(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    base = save_base(qwen_model(seed=0), tmp_path / "base")
    peft_model = lora_adapter(qwen_model(seed=0), tmp_path / "adapter", seed=3, r=4, target_modules=["q_proj"])
    merged = merged_model(base, tmp_path / "adapter", "base_model")
    assert merged.parent == tmp_path / CACHE_NAME
    expected = peft_model.merge_and_unload().state_dict()
    got = load_file(str(merged / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(got[name], expected[name])
    assert not torch.equal(got[name], load_file(str(base / "model.safetensors"))[name])
    stamp = (merged / "model.safetensors").stat().st_mtime_ns
    assert merged_model(base, tmp_path / "adapter", "base_model") == merged  # the same inputs: reused
    assert (merged / "model.safetensors").stat().st_mtime_ns == stamp
