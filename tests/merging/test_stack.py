"""passthrough layer stacking (ram_trl.merging.stack) against mergekit 0.1.5 itself, on tiny Llamas built from a
config: the same tensors byte for byte, the same config.json and tokenizer files, an output transformers loads."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file

import ram_trl
from ram_trl.errors import RamTrlError
from tests.helpers import assert_no_output, qwen_model

MERGEKIT_FILES = ("tokenizer_config.json", "special_tokens_map.json", "tokenizer.json", "generation_config.json")


def _llama(path: Path, seed: int, tokenizer: bool = False, **overrides: Any) -> Path:
    settings = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 12,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": 64,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    config = transformers.LlamaConfig(**{**settings, **overrides})
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    if tokenizer:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(63)} | {"<unk>": 63}, unk_token="<unk>"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llamas(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llamas")
    return {"a": _llama(root / "a", 0, tokenizer=True), "b": _llama(root / "b", 1)}


def _stack(llamas: dict[str, Path], **extra: Any) -> dict[str, Any]:
    """Layers [0, 8) of a and [4, 12) of b: a 16-layer model."""
    return {
        "slices": [
            {"sources": [{"model": str(llamas["a"]), "layer_range": [0, 8]}]},
            {"sources": [{"model": str(llamas["b"]), "layer_range": [4, 12]}]},
        ],
        "merge_method": "passthrough",
        **extra,
    }


def _mergekit(config: dict[str, Any], out: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pytest.importorskip("mergekit", reason="mergekit is a test-only extra: pip install 'ram-trl[mergekit]'")
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

    options = MergeOptions(device="cpu", quiet=True, copy_tokenizer=True, write_model_card=False)
    run_merge(MergeConfiguration.model_validate(copy.deepcopy(config)), str(out), options=options)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    return {k: v for file in sorted(path.glob("*.safetensors")) for k, v in load_file(str(file)).items()}


def _assert_same_tensors(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype, name
        assert ours[name].view(torch.uint8).equal(value.view(torch.uint8)), name


def test_layer_stacking_equals_mergekit_and_transformers_runs_it(llamas, tmp_path):
    config = _stack(llamas, base_model=str(llamas["a"]), dtype="float16")
    _mergekit(config, tmp_path / "mergekit")
    report = ram_trl.merge(copy.deepcopy(config), tmp_path / "ours", progress=False, max_shard_size="40KB")
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "mergekit")
    _assert_same_tensors(ours, theirs)
    # by hand: output layer 9 is b's layer 5, the embeddings a's, the final norm and lm_head b's (the last slice)
    a, b = _tensors(llamas["a"]), _tensors(llamas["b"])
    assert torch.equal(ours["model.layers.9.mlp.up_proj.weight"], b["model.layers.5.mlp.up_proj.weight"].half())
    assert torch.equal(
        ours["model.layers.7.self_attn.q_proj.weight"], a["model.layers.7.self_attn.q_proj.weight"].half()
    )
    assert torch.equal(ours["model.embed_tokens.weight"], a["model.embed_tokens.weight"].half())
    assert torch.equal(ours["lm_head.weight"], b["lm_head.weight"].half())
    assert len({n for n in ours if n.startswith("model.layers.")}) == 16 * 9
    assert len(report["output"]["files"]) > 1 and (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    mine = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert mine == json.loads((tmp_path / "mergekit" / "config.json").read_text())
    assert mine["num_hidden_layers"] == 16 and mine["dtype"] == "float16"
    copied = [name for name in MERGEKIT_FILES if (tmp_path / "mergekit" / name).is_file()]
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= set(copied)
    for name in copied:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "mergekit" / name).read_bytes(), name
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert len(model.model.layers) == 16
    logits = model(torch.tensor([[1, 5, 9, 3]])).logits
    assert logits.shape == (1, 4, 64) and torch.isfinite(logits).all()
    front = (tmp_path / "ours" / "README.md").read_text().split("---")[1]
    assert "base_model_relation: merge" in front and "- passthrough" in front


def test_scale_filters_and_gradients_equal_mergekit(llamas, tmp_path):
    """mergekit's scale: per source, per slice and global, filters matched on the input tensor's name, gradients
    over the slice's layers (the zeroed o_proj/down_proj of depth up-scaling configs)."""
    config = _stack(llamas, parameters={"scale": [{"filter": "lm_head", "value": 0.5}]})
    config["slices"][0]["sources"][0]["parameters"] = {"scale": [{"filter": "q_proj", "value": [1.0, 0.25, 2.0]}]}
    config["slices"][1]["parameters"] = {
        "scale": [{"filter": "o_proj", "value": 0.0}, {"filter": "layers.6.", "value": -1.5}]
    }
    _mergekit(config, tmp_path / "mergekit")
    ram_trl.merge(copy.deepcopy(config), tmp_path / "ours", progress=False)
    ours, theirs = _tensors(tmp_path / "ours"), _tensors(tmp_path / "mergekit")
    _assert_same_tensors(ours, theirs)
    a, b = _tensors(llamas["a"]), _tensors(llamas["b"])
    assert not ours["model.layers.9.self_attn.o_proj.weight"].any()
    assert torch.equal(ours["model.layers.10.mlp.up_proj.weight"], -1.5 * b["model.layers.6.mlp.up_proj.weight"])
    q = "model.layers.{}.self_attn.q_proj.weight"
    assert torch.equal(ours[q.format(0)], a[q.format(0)]) and torch.equal(ours[q.format(7)], 2 * a[q.format(7)])
    assert torch.equal(ours["lm_head.weight"], 0.5 * b["lm_head.weight"])


def test_one_model_in_models_is_copied_whole_as_mergekit_copies_it(llamas, tmp_path):
    config = {"merge_method": "passthrough", "models": [{"model": str(llamas["b"])}], "dtype": "bfloat16"}
    ram_trl.merge(config, tmp_path / "ours", progress=False)
    b = _tensors(llamas["b"])
    assert _tensors(tmp_path / "ours").keys() == b.keys()
    assert all(torch.equal(v, b[k].bfloat16()) for k, v in _tensors(tmp_path / "ours").items())


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (
            lambda c, m: c["slices"][0]["sources"].append({"model": str(m["b"]), "layer_range": [0, 8]}),
            "lists 2 sources",
        ),
        (lambda c, m: c["slices"][1]["sources"][0].update(layer_range=[4, 13]), "is not within its layers [0, 12]"),
        (lambda c, m: c["slices"][1]["sources"][0].update(layer_range=[4, 4]), "layer_range [4, 4]"),
        (lambda c, m: c.update(tokenizer_source=str(m["b"])), "tokenizer source with passthrough"),
        (
            lambda c, m: c["slices"].append({"sources": [{"model": "no/such-model", "layer_range": [0, 1]}]}),
            "hf download no/such-model",
        ),
    ],
)
def test_bad_stacks_are_refused_in_one_line_before_anything_is_written(change, needle, llamas, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    config = _stack(llamas)
    change(config, llamas)
    with pytest.raises(RamTrlError) as info:
        ram_trl.merge(config, tmp_path / "out", progress=False)
    assert needle in str(info.value) and "\n" not in str(info.value)
    assert_no_output(tmp_path / "out")


def test_layers_of_another_architecture_are_refused(llamas, tmp_path):
    wide = _llama(tmp_path / "wide", 3, num_hidden_layers=4, intermediate_size=48)
    stack = _stack(llamas)
    stack["slices"][1]["sources"][0] = {"model": str(wide), "layer_range": [0, 4]}
    with pytest.raises(
        RamTrlError, match=r"layer 0 of .*wide does not match the first output layer \(tensor 'model.layers.0.mlp"
    ):
        ram_trl.merge(stack, tmp_path / "out", progress=False)
    assert_no_output(tmp_path / "out")
    with pytest.raises(RamTrlError, match="passthrough writes a deeper model"):
        ram_trl.merge(_stack(llamas), tmp_path / "out", progress=False, output_format="lora", lora_rank=2)


def test_per_layer_config_lists_follow_the_stacked_layers(tmp_path):
    """Qwen2's layer_types (one entry per layer, checked by transformers) rebuilt from each source layer's entry."""
    kinds = ["full_attention", "sliding_attention", "full_attention", "sliding_attention"]
    qwen_model(0, num_hidden_layers=4, layer_types=kinds, use_sliding_window=True).save_pretrained(tmp_path / "a")
    qwen_model(1, num_hidden_layers=4).save_pretrained(tmp_path / "b")
    config = {
        "merge_method": "passthrough",
        "slices": [
            {"sources": [{"model": str(tmp_path / "a"), "layer_range": [1, 3]}]},
            {"sources": [{"model": str(tmp_path / "b"), "layer_range": [0, 3]}]},
        ],
    }
    ram_trl.merge(config, tmp_path / "out", progress=False)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["num_hidden_layers"] == 5
    assert written["layer_types"] == ["sliding_attention", "full_attention", *["full_attention"] * 3]
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()
