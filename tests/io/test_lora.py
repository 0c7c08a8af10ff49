"""LoRA adapters as merge inputs, against PEFT itself (real adapters made with peft in the tests)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

import ram_trl
from ram_trl.errors import CheckpointError
from ram_trl.io.lora import CONV1D_MODEL_TYPES, conv1d_modules
from tests import reference
from tests.helpers import dense_lora_deltas, lora_adapter, qwen_model, save_base

peft = pytest.importorskip("peft", reason="peft is needed to build real LoRA adapters")


def _merge_config(base, agents, method="task_arithmetic", agent_params=None, **params):
    return {
        "merge_method": method,
        "base_model": str(base),
        "models": [{"model": str(a), "parameters": agent_params or {}} for a in agents],
        "parameters": params,
        "out_dtype": "float32",
    }


LORA_VARIANTS = {
    "plain": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
    "rslora_patterns": {
        "r": 4,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["q_proj", "o_proj", "up_proj"],
        "rank_pattern": {"o_proj": 2},
        "alpha_pattern": {"up_proj": 3},
    },
    "embedding_and_modules_to_save": {
        "r": 3,
        "lora_alpha": 6,
        "target_modules": ["embed_tokens", "k_proj"],
        "modules_to_save": ["lm_head"],
        "bias": "lora_only",
    },
    # lora_B carries a bias (saved as M.lora_B.bias): merged bias = base bias + lora_B.bias * scaling
    "lora_bias": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "lora_bias": True},
}


@pytest.mark.parametrize("variant", list(LORA_VARIANTS))
def test_single_lora_agent_equals_peft_merge_and_unload(tmp_path, variant):
    base = save_base(qwen_model(), tmp_path / "base")
    peft_model = lora_adapter(qwen_model(), tmp_path / "adapter", **LORA_VARIANTS[variant])
    if variant in ("embedding_and_modules_to_save", "lora_bias"):  # saved full tensors / bias deltas non-zero
        moved = ("lora_B.default.bias",) if variant == "lora_bias" else ("base_layer.bias",)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "modules_to_save" in name or name.endswith(moved):
                    param.add_(0.01)
        peft_model.save_pretrained(tmp_path / "adapter")
    merged_reference = peft_model.merge_and_unload().state_dict()
    report = ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)
    assert report["agents"][0]["kind"] == "lora"
    ours = reference.load_state_dict(tmp_path / "out")
    assert set(ours) == set(merged_reference)
    changed = 0
    for name, value in merged_reference.items():
        # PEFT's float32 product and ours round differently: a few float32 ulps of the tensor's largest value apart
        # (the random embedding LoRA's deltas reach ~8, and an element where base and delta cancel keeps their error)
        scale = max(1.0, float(value.abs().max()))
        torch.testing.assert_close(ours[name], value.float(), rtol=1e-6, atol=1e-7 * scale, msg=name)
        changed += int(not torch.equal(ours[name], load_file(str(base / "model.safetensors"))[name]))
    assert changed >= 3  # several tensors really moved
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| lora |" in card and "B @ A * scaling" in card


def test_fan_in_fan_out_gpt2_conv1d(tmp_path):
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64)
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "base")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    peft_model = lora_adapter(
        model, tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True
    )
    merged_reference = peft_model.merge_and_unload().state_dict()
    ram_trl.merge(_merge_config(tmp_path / "base", [tmp_path / "adapter"]), tmp_path / "out", progress=False)
    ours = reference.load_state_dict(tmp_path / "out")
    for name, value in ours.items():
        torch.testing.assert_close(value, merged_reference[name].float(), rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(
        ours["transformer.h.0.attn.c_attn.weight"],
        load_file(str(tmp_path / "base" / "model.safetensors"))["transformer.h.0.attn.c_attn.weight"],
    )


def test_mixed_full_and_lora_ram_merge_equals_reference(tmp_path):
    base_model = qwen_model()
    base = save_base(base_model, tmp_path / "base")
    base_state = load_file(str(base / "model.safetensors"))
    # a full agent: a sparse RL-like update of the base
    full_state = {}
    generator = torch.Generator().manual_seed(5)
    for name, value in base_state.items():
        keep = torch.rand(value.shape, generator=generator) < 0.3
        full_state[name] = value + keep * torch.randn(value.shape, generator=generator) * 0.02
    (tmp_path / "full").mkdir()
    save_file(full_state, str(tmp_path / "full" / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "full" / "config.json").write_text((base / "config.json").read_text())
    peft_model = lora_adapter(qwen_model(), tmp_path / "lora", r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"])
    lora_deltas = dense_lora_deltas(peft_model)
    report = ram_trl.merge(
        _merge_config(base, [tmp_path / "full", tmp_path / "lora"], "ram_plus", r=0.1, alpha=2.0),
        tmp_path / "out",
        progress=False,
    )
    assert [a["kind"] for a in report["agents"]] == ["full", "lora"]
    taus = {
        name: [full_state[name] - value, lora_deltas.get(name, torch.zeros_like(value))]
        for name, value in base_state.items()
    }
    expected, stats = reference.ram_from_task_vectors(base_state, taus, r=0.1, alpha=2.0)
    ours = reference.load_state_dict(tmp_path / "out")
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-6, atol=1e-7, msg=name)
    assert [a["unique"] for a in report["agents"]] == stats["unique"]
    assert [a["shared"] for a in report["agents"]] == stats["shared"]
    # the LoRA delta is dense on its target modules and absent elsewhere
    lora_active = report["agents"][1]["active"]
    assert lora_active == sum(int((d.abs() > 1e-5).sum()) for d in lora_deltas.values())


def test_dora_is_refused(tmp_path):
    base = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "dora", r=4, lora_alpha=8, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(CheckpointError, match="DoRA"):
        ram_trl.merge(_merge_config(base, [tmp_path / "dora"]), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_other_peft_method_is_named(tmp_path):
    base = save_base(qwen_model(), tmp_path / "base")
    model = peft.get_peft_model(
        qwen_model(), peft.IA3Config(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"])
    )
    model.save_pretrained(tmp_path / "ia3")
    with pytest.raises(CheckpointError, match="PEFT IA3 adapter"):
        ram_trl.merge(_merge_config(base, [tmp_path / "ia3"]), tmp_path / "out", progress=False)


def test_adapter_for_another_shape_names_module_and_shapes(tmp_path):
    base = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(hidden_size=48, intermediate_size=64), tmp_path / "wide", r=4, target_modules=["q_proj"])
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.q_proj\.weight.*\[48, 48\].*\[32, 32\]"):
        ram_trl.merge(_merge_config(base, [tmp_path / "wide"]), tmp_path / "out", progress=False)


def test_missing_adapter_weights(tmp_path):
    base = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "adapter", r=4, target_modules=["q_proj"])
    (tmp_path / "adapter" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors"):
        ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)


def test_adapter_base_name_mismatch_warns(tmp_path):
    base = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "adapter", r=4, target_modules=["q_proj"])
    config_path = tmp_path / "adapter" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = "Org/Some-Other-Model"
    config_path.write_text(json.dumps(config))
    with pytest.warns(UserWarning, match="Some-Other-Model"):
        report = ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)
    assert any("Some-Other-Model" in w for w in report["warnings"])


def test_several_adapter_names_in_one_file_are_refused(tmp_path):
    base = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "adapter", r=2, lora_alpha=4, target_modules=["q_proj"])
    factors = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    both = {}
    for key, value in factors.items():  # the same factors under two adapter names, as a raw state dict holds them
        for adapter in ("default", "other"):
            both[key.replace(".lora_A.", f".lora_A.{adapter}.").replace(".lora_B.", f".lora_B.{adapter}.")] = (
                value.clone()
            )
    save_file(both, str(tmp_path / "adapter" / "adapter_model.safetensors"))
    with pytest.raises(CheckpointError, match=r"several adapters \('default', 'other'.*selected_adapters"):
        ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)


def test_a_hand_edited_fan_in_fan_out_on_linear_layers_is_read_as_peft_applies_it(tmp_path):
    """PEFT ignores ``fan_in_fan_out: true`` on ``nn.Linear`` (it warns and resets it): the delta stays B @ A."""
    base = save_base(qwen_model(), tmp_path / "base")
    peft_model = lora_adapter(
        qwen_model(), tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["up_proj", "down_proj"]
    )
    merged_reference = peft_model.merge_and_unload().state_dict()
    config_file = tmp_path / "adapter" / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "fan_in_fan_out": True}))
    ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)
    ours = reference.load_state_dict(tmp_path / "out")
    for name, value in merged_reference.items():
        torch.testing.assert_close(ours[name], value.float(), rtol=1e-6, atol=1e-7, msg=name)


def _hand_edit(adapter, **changes):
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **changes}))


def _assert_merge_equals(ours_dir, merged_reference, base, moved):
    ours = reference.load_state_dict(ours_dir)
    assert len(ours) >= len(merged_reference) - 1  # GPT-2's tied lm_head is saved once, as its embedding
    for name, value in ours.items():
        torch.testing.assert_close(value, merged_reference[name].float(), rtol=1e-6, atol=1e-7, msg=name)
    base_state = load_file(str(base / "model.safetensors"))
    assert not torch.equal(ours[moved], base_state[moved].float())  # the square target really moved


def test_a_fan_in_fan_out_flag_on_square_linear_weights_is_read_as_peft_applies_it(tmp_path):
    """Square ``nn.Linear`` targets (a tiny Llama's q_proj and o_proj): their shape cannot tell the layout, the base's
    architecture does; PEFT resets a hand-edited ``fan_in_fan_out: true`` to False there."""
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=96,
    )
    torch.manual_seed(0)
    base = save_base(LlamaForCausalLM(config), tmp_path / "base")
    torch.manual_seed(0)
    peft_model = lora_adapter(
        LlamaForCausalLM(config), tmp_path / "adapter", r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]
    )
    merged_reference = peft_model.merge_and_unload().state_dict()
    _hand_edit(tmp_path / "adapter", fan_in_fan_out=True)
    ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)
    _assert_merge_equals(tmp_path / "out", merged_reference, base, "model.layers.0.self_attn.o_proj.weight")


def test_a_fan_in_fan_out_flag_off_on_square_conv1d_weights_is_read_as_peft_applies_it(tmp_path):
    """A tiny GPT-2's attention c_proj is a square ``Conv1D``: PEFT transposes its delta whatever the flag says."""
    config = GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=96, n_positions=64)
    torch.manual_seed(0)
    base = save_base(GPT2LMHeadModel(config), tmp_path / "base")
    torch.manual_seed(0)
    peft_model = lora_adapter(
        GPT2LMHeadModel(config),
        tmp_path / "adapter",
        r=4,
        lora_alpha=8,
        target_modules=["c_proj"],
        fan_in_fan_out=True,
    )
    merged_reference = peft_model.merge_and_unload().state_dict()
    _hand_edit(tmp_path / "adapter", fan_in_fan_out=False)
    ram_trl.merge(_merge_config(base, [tmp_path / "adapter"]), tmp_path / "out", progress=False)
    _assert_merge_equals(tmp_path / "out", merged_reference, base, "transformer.h.0.attn.c_proj.weight")


def test_conv1d_model_types_are_those_transformers_builds_with_conv1d():
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    models = Path(transformers.__file__).parent / "models"
    uses = {
        path.parent.name
        for path in models.glob("*/modeling_*.py")
        if re.search(r"from \.\.\.pytorch_utils import[^\n]*\bConv1D\b", path.read_text())
    }
    assert {t for t in CONFIG_MAPPING_NAMES if model_type_to_module_name(t) in uses} == CONV1D_MODEL_TYPES


def test_conv1d_modules_of_a_base(tmp_path):
    GPT2Config(n_embd=32, n_layer=1, n_head=4, vocab_size=96, n_positions=64).save_pretrained(tmp_path / "gpt2")
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4).save_pretrained(
        tmp_path / "llama"
    )
    assert conv1d_modules(tmp_path / "gpt2" / "config.json") == {
        "transformer.h.0.attn.c_attn",
        "transformer.h.0.attn.c_proj",
        "transformer.h.0.mlp.c_fc",
        "transformer.h.0.mlp.c_proj",
    }
    assert conv1d_modules(tmp_path / "llama" / "config.json") == frozenset()
    (tmp_path / "remote.json").write_text('{"model_type": "custom", "auto_map": {"AutoModel": "m.M"}}')
    assert conv1d_modules(tmp_path / "remote.json") is None  # remote code: the flag decides
    assert conv1d_modules(tmp_path / "missing.json") is None
