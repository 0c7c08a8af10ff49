"""Anatomy buckets: module types and layers from tensor names, on Qwen2- and Llama-shaped checkpoints."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

import ram_trl
from ram_trl.statistics.anatomy import aggregate, classify, layer_index, module_type
from ram_trl.synthetic import make_base_checkpoint

QWEN2_TYPES = {
    "lm_head.weight": ("lm_head", None),
    "model.embed_tokens.weight": ("embedding", None),
    "model.norm.weight": ("norm", None),
    "model.layers.{i}.input_layernorm.weight": ("norm", "i"),
    "model.layers.{i}.post_attention_layernorm.weight": ("norm", "i"),
    "model.layers.{i}.self_attn.q_proj.weight": ("attn_q", "i"),
    "model.layers.{i}.self_attn.q_proj.bias": ("attn_q", "i"),
    "model.layers.{i}.self_attn.k_proj.weight": ("attn_k", "i"),
    "model.layers.{i}.self_attn.k_proj.bias": ("attn_k", "i"),
    "model.layers.{i}.self_attn.v_proj.weight": ("attn_v", "i"),
    "model.layers.{i}.self_attn.v_proj.bias": ("attn_v", "i"),
    "model.layers.{i}.self_attn.o_proj.weight": ("attn_o", "i"),
    "model.layers.{i}.mlp.gate_proj.weight": ("mlp_gate", "i"),
    "model.layers.{i}.mlp.up_proj.weight": ("mlp_up", "i"),
    "model.layers.{i}.mlp.down_proj.weight": ("mlp_down", "i"),
}


def _expand(types: dict, layers: int) -> dict[str, tuple[str, int | None]]:
    out = {}
    for pattern, (module, layer) in types.items():
        if "{i}" in pattern:
            out.update({pattern.format(i=i): (module, i) for i in range(layers)})
        else:
            out[pattern] = (module, layer)
    return out


@pytest.mark.parametrize(
    ("name", "module", "layer"),
    [
        ("model.layers.3.self_attn.qkv_proj.weight", "attn_qkv", 3),
        ("model.layers.12.mlp.gate_up_proj.weight", "mlp_gate_up", 12),
        ("transformer.wte.weight", "embedding", None),
        ("transformer.h.2.ln_1.weight", "norm", 2),
        ("transformer.ln_f.bias", "norm", None),
        ("model.layers.7.self_attn.q_norm.weight", "norm", 7),
        ("model.layers.1.self_attn.rotary_emb.inv_freq", "other", 1),
        ("model.decoder.layers.0.self_attn.out_proj.weight", "attn_o", 0),
        ("gpt_neox.layers.5.attention.query_key_value.weight", "attn_qkv", 5),
        ("model.vision_tower.blocks.3.mlp.fc1.weight", "other", None),
        ("model.layers_norm.weight", "norm", None),
        ("score.weight", "other", None),
    ],
)
def test_names_of_other_architectures(name, module, layer):
    assert (module_type(name), layer_index(name)) == (module, layer)
    assert (
        classify(name).family
        == {
            "attn_qkv": "attention",
            "attn_o": "attention",
            "mlp_gate_up": "mlp",
            "embedding": "embedding",
            "norm": "norm",
            "other": "other",
        }[module]
    )


def test_aggregate_sums_by_bucket_in_order_and_skips_none():
    items = [("a.layers.1.x", 1), ("a.layers.0.x", 2), ("b", 5), ("a.layers.1.y", 3)]
    assert aggregate(items, layer_index, lambda x, y: x + y) == {1: 4, 0: 2}


# ---------------------------------------------------------------------------------------------------------------
# Real checkpoints


def _agent(base: Path, out: Path, changes: dict[str, Callable[[torch.Tensor], torch.Tensor]]) -> Path:
    """A copy of ``base`` with ``changes[name](tensor)`` applied (every other tensor unchanged)."""
    shutil.copytree(base, out)
    state = load_file(str(out / "model.safetensors"))
    for name, change in changes.items():
        state[name] = change(state[name]).contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _add(value: float, rows: int | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    def change(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.clone()
        tensor[:rows] += value
        return tensor

    return change


def _module(result: dict, module: str) -> dict:
    return next(m for m in result["anatomy"]["modules"] if m["module"] == module)


def test_qwen2_buckets_and_densities(tmp_path):
    base = make_base_checkpoint(
        tmp_path / "base", hidden_size=32, num_layers=2, intermediate_size=64, dtype=torch.float32
    )
    agent = _agent(
        base,
        tmp_path / "agent",
        {
            "model.layers.1.self_attn.q_proj.weight": _add(0.01),
            "model.layers.0.input_layernorm.weight": _add(0.5),
            "model.embed_tokens.weight": _add(0.01, rows=10),
        },
    )
    result = ram_trl.analyze(base, [agent], progress=False)
    names = [t["name"] for t in result["tensors_detail"]]
    expected = _expand(QWEN2_TYPES, 2)
    assert sorted(names) == sorted(expected)
    assert {t["name"]: (t["module"], t["layer"]) for t in result["tensors_detail"]} == expected

    # q: 2 x (32 x 32 weight + 32 bias) = 2112 elements, 1024 changed; norms: 5 x 32; embeddings: 100 x 32
    assert _module(result, "attn_q")["numel"] == 2112
    assert _module(result, "attn_q")["density"] == [1024 / 2112]
    assert _module(result, "norm")["density"] == [32 / 160]
    assert _module(result, "embedding")["density"] == [320 / 3200]
    for module in ("attn_k", "attn_v", "attn_o", "mlp_gate", "mlp_up", "mlp_down", "lm_head"):
        assert _module(result, module)["density"] == [0.0], module
    assert [m["tensors"] for m in result["anatomy"]["modules"]] == [4, 4, 4, 2, 2, 2, 2, 5, 1, 1]
    families = {f["family"]: f for f in result["anatomy"]["families"]}
    assert list(families) == ["attention", "mlp", "norm", "embedding", "lm_head"]
    assert families["attention"]["density"] == [1024 / (2112 + 2 * 1056 + 2048)]
    # a layer: q 1056, k 528, v 528, o 1024, gate/up/down 3 x 2048, two norms 64 -> 9344 elements
    layers = result["anatomy"]["layers"]
    assert [layer["layer"] for layer in layers] == [0, 1]
    assert [layer["numel"] for layer in layers] == [9344, 9344]
    assert [layer["density"] for layer in layers] == [[32 / 9344], [1024 / 9344]]
    assert layers[1]["modules"]["attn_q"] == [1024 / 1056]
    assert layers[0]["modules"]["norm"] == [32 / 64]
    assert layers[0]["modules"]["attn_q"] == [0.0]


def _llama(path: Path) -> Path:
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=40,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(str(path))
    return path


def test_llama_buckets_and_densities(tmp_path):
    base = _llama(tmp_path / "base")
    assert json.loads((base / "config.json").read_text())["model_type"] == "llama"
    agent = _agent(
        base,
        tmp_path / "agent",
        {
            "model.layers.2.mlp.down_proj.weight": _add(0.25),
            "model.layers.0.self_attn.v_proj.weight": _add(0.25, rows=4),
            "lm_head.weight": _add(0.25, rows=8),
            "model.norm.weight": _add(0.5),
        },
    )
    result = ram_trl.analyze(base, [agent], progress=False)
    llama_types = {k: v for k, v in QWEN2_TYPES.items() if not k.endswith(".bias")}
    assert {t["name"]: (t["module"], t["layer"]) for t in result["tensors_detail"]} == _expand(llama_types, 3)
    # head_dim 4, 2 kv heads: k/v are 8 x 16; down 16 x 40; lm_head 64 x 16
    assert _module(result, "mlp_down")["density"] == [640 / (3 * 640)]
    assert _module(result, "attn_v")["density"] == [64 / (3 * 128)]
    assert _module(result, "lm_head")["density"] == [128 / 1024]
    assert _module(result, "norm")["density"] == [16 / (7 * 16)]
    assert _module(result, "embedding")["density"] == [0.0]
    layers = result["anatomy"]["layers"]
    assert [layer["layer"] for layer in layers] == [0, 1, 2]
    # a layer: q 256, k 128, v 128, o 256, gate/up/down 3 x 640, two norms 32 -> 2720 elements
    assert [layer["density"] for layer in layers] == [[64 / 2720], [0.0], [640 / 2720]]
    assert layers[2]["modules"]["mlp_down"] == [1.0]
    assert result["total_elements"] == 3 * 2720 + 16 + 2 * 1024
