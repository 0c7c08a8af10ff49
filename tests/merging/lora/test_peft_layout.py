"""ram_trl/merging/lora/peft_layout.py: how merged tensors map onto a PEFT adapter (LoRA targets, biases, modules_to_save), from a
real tiny Qwen2 config (the exported adapters are loaded back with real PEFT in tests/merging/lora/test_export.py)."""

from __future__ import annotations

import pytest

from ram_trl.errors import CheckpointError
from ram_trl.merging.lora.peft_layout import build_architecture, classify, exact_list, pattern_keys
from tests.helpers import qwen_model

Q = "model.layers.0.self_attn.q_proj"


def _architecture(tmp_path, **overrides):
    qwen_model(**overrides).config.save_pretrained(tmp_path)
    return build_architecture(tmp_path)


def test_architecture_of_an_untied_model(tmp_path):
    architecture = _architecture(tmp_path)
    assert architecture.name == "Qwen2ForCausalLM"
    assert (architecture.input_embedding, architecture.output_embedding) == ("model.embed_tokens", "lm_head")
    assert architecture.is_linear(Q) and not architecture.is_linear("model.norm")
    assert architecture.is_leaf("model.norm") and not architecture.is_leaf("model.layers.0")
    assert architecture.aliases["lm_head.weight"] == ["lm_head.weight"]


def test_classify(tmp_path):
    architecture = _architecture(tmp_path)
    assert classify(f"{Q}.weight", architecture) == ("lora", Q)
    assert classify(f"{Q}.bias", architecture) == ("bias", Q)  # Qwen2's q/k/v projections have biases
    assert classify("model.norm.weight", architecture) == ("save", "model.norm")
    assert classify("model.embed_tokens.weight", architecture) == ("save", "model.embed_tokens")
    kind, reason = classify("model.rotary_emb.inv_freq", architecture)
    assert kind == "skip" and "has no parameter of this name" in reason


def test_tied_embeddings_are_saved_once(tmp_path):
    architecture = _architecture(tmp_path, tie_word_embeddings=True)
    assert sorted(architecture.aliases["lm_head.weight"]) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert classify("lm_head.weight", architecture) == ("save", "model.embed_tokens")


def test_a_broken_config_is_a_checkpoint_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "no_such_model"}')
    with pytest.raises(CheckpointError, match="cannot build its architecture from config.json"):
        build_architecture(tmp_path)


def test_exact_list():
    # PEFT's list rule: a module is targeted when its name equals an entry or ends with "." + an entry
    candidates = ["a.q_proj", "a.k_proj", "b.q_proj", "b.gate"]
    assert exact_list(["a.q_proj", "b.q_proj"], candidates)
    assert not exact_list(["q_proj"], ["q_proj", "a.q_proj"])  # "q_proj" also selects "a.q_proj"
    assert not exact_list(["a.q_proj"], ["a.q_proj", "x.a.q_proj"])  # ... and "a.q_proj" selects "x.a.q_proj"


def test_pattern_keys():
    targets = ["a.q_proj", "b.q_proj", "a.k_proj"]
    simple = {"a.q_proj": 4, "b.q_proj": 8}
    assert pattern_keys(simple, targets) is simple
    # "q_proj" also matches the end of "a.q_proj" and would give it the wrong value: keys get anchored and escaped
    clashing = {"q_proj": 2, "a.q_proj": 4}
    assert pattern_keys(clashing, ["q_proj", "a.q_proj"]) == {"^q_proj": 2, r"^a\.q_proj": 4}
