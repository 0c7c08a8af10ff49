"""Tests of ram_trl.synthetic: synthetic base checkpoints and RL-like agents built from configs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from ram_trl.synthetic import (
    build_char_tokenizer,
    generate_example,
    make_agent_set,
    make_base_checkpoint,
    make_rl_agent,
)

INDEX = "model.safetensors.index.json"


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return tensors


def bits(tensor: torch.Tensor) -> torch.Tensor:
    assert tensor.dtype == torch.bfloat16
    return tensor.view(torch.int16)


def changed(base: dict[str, torch.Tensor], agent: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per tensor, the elements whose stored bits differ."""
    return {name: bits(agent[name]) != bits(base[name]) for name in base}


def fraction(masks: dict[str, torch.Tensor]) -> float:
    return sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())


def weight_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*.safetensors"))


@pytest.fixture(scope="module")
def sharded_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_base_checkpoint(tmp_path_factory.mktemp("base") / "base", max_shard_size="20KB")


@pytest.fixture(scope="module")
def base_tensors(sharded_base: Path) -> dict[str, torch.Tensor]:
    return load_dir(sharded_base)


# ----------------------------------------------------------------------------------------------------------------
# Tokenizer and base checkpoints
# ----------------------------------------------------------------------------------------------------------------


def test_char_tokenizer_roundtrip(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == len(loaded) == 100
    text = "Hello, world!\n  x = {1: '~'}"
    ids = loaded(text)["input_ids"]
    assert len(ids) == len(text)  # one token per character
    assert ids == tokenizer(text)["input_ids"]
    assert loaded.decode(ids) == text
    assert (loaded.pad_token, loaded.bos_token, loaded.eos_token, loaded.unk_token) == (
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    )
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id, loaded.unk_token_id) == (0, 1, 2, 3)


def test_custom_alphabet(tmp_path: Path) -> None:
    tokenizer = build_char_tokenizer(tmp_path, alphabet="ab\n")
    assert len(tokenizer) == 7
    assert tokenizer.decode(tokenizer("ab\nba")["input_ids"]) == "ab\nba"


def test_base_checkpoint_loads_and_generates(tmp_path: Path) -> None:
    path = make_base_checkpoint(tmp_path / "base")
    assert (path / "model.safetensors").is_file() and not (path / INDEX).exists()
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size >= len(tokenizer)
    text = "def f(x):\n    return"
    inputs = tokenizer(text, return_tensors="pt")
    assert tokenizer.decode(inputs["input_ids"][0]) == text  # the Qwen2 tokenizer class loads it faithfully
    output = model.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert output.shape == (1, inputs["input_ids"].shape[1] + 4)
    generation = json.loads((path / "generation_config.json").read_text())
    assert (generation["pad_token_id"], generation["bos_token_id"], generation["eos_token_id"]) == (0, 1, 2)


def test_base_rejects_small_vocab(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        make_base_checkpoint(tmp_path / "base", vocab_size=50)


def test_sharded_base_index(sharded_base: Path) -> None:
    index = json.loads((sharded_base / INDEX).read_text())
    files = weight_files(sharded_base)
    assert len(files) > 1
    assert sorted(set(index["weight_map"].values())) == files
    stored: dict[str, str] = {}
    total = 0
    for file in files:
        with safe_open(str(sharded_base / file), framework="pt") as handle:
            assert handle.metadata() == {"format": "pt"}
            names = handle.keys()
            for name in names:
                stored[name] = file
                tensor = handle.get_tensor(name)
                total += tensor.numel() * tensor.element_size()
    assert stored == index["weight_map"]
    assert index["metadata"]["total_size"] == total
    model, info = AutoModelForCausalLM.from_pretrained(sharded_base, output_loading_info=True)
    assert not info["missing_keys"]


@pytest.mark.parametrize("tie", [False, True])
def test_stream_writer_matches_save_pretrained(tmp_path: Path, tie: bool) -> None:
    kwargs = dict(tie_word_embeddings=tie, max_shard_size="20KB", num_layers=3)
    eager = make_base_checkpoint(tmp_path / "eager", **kwargs)
    stream = make_base_checkpoint(tmp_path / "stream", materialize="stream", **kwargs)
    eager_tensors, stream_tensors = load_dir(eager), load_dir(stream)
    assert eager_tensors.keys() == stream_tensors.keys()
    assert ("lm_head.weight" in stream_tensors) is not tie
    for name, tensor in eager_tensors.items():
        assert stream_tensors[name].shape == tensor.shape, name
        assert stream_tensors[name].dtype == tensor.dtype == torch.bfloat16, name
    # Same shard plan, index and config as save_pretrained.
    assert weight_files(eager) == weight_files(stream)
    assert json.loads((eager / INDEX).read_text()) == json.loads((stream / INDEX).read_text())
    assert json.loads((eager / "config.json").read_text()) == json.loads((stream / "config.json").read_text())
    # Values: N(0, 0.02) matrices, unit norms, zero biases.
    assert torch.equal(stream_tensors["model.norm.weight"], torch.ones(64, dtype=torch.bfloat16))
    assert not stream_tensors["model.layers.0.self_attn.q_proj.bias"].any()
    std = stream_tensors["model.layers.0.mlp.up_proj.weight"].float().std().item()
    assert 0.018 < std < 0.022
    model, info = AutoModelForCausalLM.from_pretrained(stream, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(stream)
    output = model.generate(**tokenizer("abc", return_tensors="pt"), max_new_tokens=2, do_sample=False)
    assert output.shape == (1, 5)


def test_base_is_deterministic(tmp_path: Path) -> None:
    for mode in ("eager", "stream"):
        first = make_base_checkpoint(tmp_path / f"{mode}_a", materialize=mode, seed=7)
        second = make_base_checkpoint(tmp_path / f"{mode}_b", materialize=mode, seed=7)
        for file in sorted(p.name for p in first.iterdir()):
            assert (first / file).read_bytes() == (second / file).read_bytes(), (mode, file)


# ----------------------------------------------------------------------------------------------------------------
# Agents
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("density", [0.03, 0.46])
def test_agent_density_sign_and_finiteness(tmp_path, sharded_base, base_tensors, density: float) -> None:
    agent_dir = make_rl_agent(sharded_base, tmp_path / "agent", density=density, seed=11)
    agent = load_dir(agent_dir)
    masks = changed(base_tensors, agent)
    assert abs(fraction(masks) - density) < 0.01
    for name, mask in masks.items():
        if mask.numel() >= 4096:
            assert abs(mask.float().mean().item() - density) < 0.02, name
        base_w, agent_w = base_tensors[name].float(), agent[name].float()
        assert torch.isfinite(agent_w).all(), name
        assert not (base_w * agent_w < 0).any(), name  # no sign flips
        assert torch.equal(agent_w.signbit(), base_w.signbit()), name
        # bf16: where both values are >= 2**-9 in magnitude, the eps = 1e-5 mask is the changed-bits mask.
        eps_mask = (agent_w - base_w).abs() > 1e-5
        large = torch.minimum(base_w.abs(), agent_w.abs()) >= 2**-9
        assert torch.equal(eps_mask[large], mask[large]), name


def test_agent_steps_are_heavy_tailed(tmp_path, sharded_base, base_tensors) -> None:
    agent = load_dir(make_rl_agent(sharded_base, tmp_path / "agent", density=0.5, seed=3, max_ulps=64))
    steps = []
    for name, base_w in base_tensors.items():
        if base_w.dim() == 2:
            old = bits(base_w).int() & 0x7FFF
            new = bits(agent[name]).int() & 0x7FFF
            steps.append((new - old)[new != old].abs())
    steps = torch.cat(steps)
    assert steps.min() >= 1 and steps.max() <= 64
    assert 0.55 < (steps == 1).float().mean() < 0.70  # most steps are one ulp ...
    assert (steps >= 16).any()  # ... with a long tail


def test_support_is_nested_in_density(tmp_path, sharded_base, base_tensors) -> None:
    """Same seeds: the support at a lower density is a subset of the support at a higher one."""
    low = changed(base_tensors, load_dir(make_rl_agent(sharded_base, tmp_path / "lo", density=0.2, seed=5)))
    high = changed(base_tensors, load_dir(make_rl_agent(sharded_base, tmp_path / "hi", density=0.6, seed=5)))
    for name in low:
        assert not (low[name] & ~high[name]).any(), name
    zero = load_dir(make_rl_agent(sharded_base, tmp_path / "zero", density=0.0, seed=5))
    assert all(torch.equal(zero[n], base_tensors[n]) for n in base_tensors)


def test_overlap_one_gives_identical_supports(tmp_path, sharded_base, base_tensors) -> None:
    first, second = make_agent_set(sharded_base, tmp_path, (0.3, 0.3), overlap=1.0)
    a, b = load_dir(first), load_dir(second)
    masks_a, masks_b = changed(base_tensors, a), changed(base_tensors, b)
    for name in masks_a:
        assert torch.equal(masks_a[name], masks_b[name]), name
    assert any(not torch.equal(a[n], b[n]) for n in a)  # different seeds: different steps


@pytest.mark.parametrize("overlap", [0.0, 0.5])
def test_overlap_fraction(tmp_path, sharded_base, base_tensors, overlap: float) -> None:
    d_a, d_b = 0.3, 0.5
    paths = make_agent_set(sharded_base, tmp_path, (d_a, d_b), overlap=overlap, seed=1)
    masks_a, masks_b = (changed(base_tensors, load_dir(p)) for p in paths)
    both = fraction({n: masks_a[n] & masks_b[n] for n in masks_a})
    expected = overlap * min(d_a, d_b) + (1 - overlap) * d_a * d_b  # 0.15 independent, 0.225 half shared
    assert abs(both - expected) < 0.01


def test_agent_is_deterministic(tmp_path, sharded_base) -> None:
    first = make_rl_agent(sharded_base, tmp_path / "a", density=0.4, seed=9)
    second = make_rl_agent(sharded_base, tmp_path / "b", density=0.4, seed=9)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    other = make_rl_agent(sharded_base, tmp_path / "c", density=0.4, seed=10)
    assert any((first / n).read_bytes() != (other / n).read_bytes() for n in weight_files(first))


def test_agent_keeps_shard_layout_and_files(tmp_path, sharded_base) -> None:
    agent = make_rl_agent(sharded_base, tmp_path / "agent", density=0.1, seed=2)
    assert weight_files(agent) == weight_files(sharded_base)
    assert json.loads((agent / INDEX).read_text()) == json.loads((sharded_base / INDEX).read_text())
    for file in weight_files(agent):
        with safe_open(str(agent / file), "pt") as a, safe_open(str(sharded_base / file), "pt") as b:
            assert sorted(a.keys()) == sorted(b.keys())
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (agent / name).read_bytes() == (sharded_base / name).read_bytes()
    model, info = AutoModelForCausalLM.from_pretrained(agent, output_loading_info=True)
    assert not info["missing_keys"] and model.dtype == torch.bfloat16


def test_single_file_agent(tmp_path) -> None:
    base = make_base_checkpoint(tmp_path / "base", tie_word_embeddings=True)
    agent = make_rl_agent(base, tmp_path / "agent", density=0.5, seed=0)
    assert weight_files(agent) == ["model.safetensors"] and not (agent / INDEX).exists()
    assert "lm_head.weight" not in load_dir(agent)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_agents(tmp_path, sharded_base, base_tensors, dtype: torch.dtype) -> None:
    agent = load_dir(make_rl_agent(sharded_base, tmp_path / "agent", density=0.4, seed=4, dtype=dtype))
    total = active = 0
    for name, base_w in base_tensors.items():
        base_w, agent_w = base_w.to(dtype), agent[name]
        assert agent_w.dtype == dtype
        assert torch.isfinite(agent_w).all() and torch.equal(agent_w.signbit(), base_w.signbit())
        mask = agent_w != base_w
        total += mask.numel()
        active += int(mask.sum())
        relative = (agent_w.float() - base_w.float()).abs() / base_w.float().abs().clamp(min=1e-3)
        assert relative.max() <= 64 * 2**-8 * 1.01
    assert abs(active / total - 0.4) < 0.01
    config = json.loads((tmp_path / "agent" / "config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.")


def test_agent_argument_checks(tmp_path, sharded_base) -> None:
    with pytest.raises(ValueError, match="density"):
        make_rl_agent(sharded_base, tmp_path / "a", density=1.5, seed=0)
    with pytest.raises(ValueError, match="overlap"):
        make_rl_agent(sharded_base, tmp_path / "a", density=0.5, seed=0, overlap=-0.1)
    with pytest.raises(ValueError, match="base directory"):
        make_rl_agent(sharded_base, sharded_base, density=0.5, seed=0)
    with pytest.raises(FileNotFoundError):
        make_rl_agent(tmp_path / "missing", tmp_path / "a", density=0.5, seed=0)


def test_generate_example(tmp_path) -> None:
    result = generate_example(tmp_path / "example", hidden_size=32, intermediate_size=64)
    assert result["base"] == (tmp_path / "example" / "base").resolve()
    assert [p.name for p in result["agents"]] == ["agent_0", "agent_1", "agent_2"]
    config = yaml.safe_load(result["config"].read_text())
    assert config["merge_method"] == "ram_plus"
    assert config["base_model"] == str(result["base"])
    assert [m["model"] for m in config["models"]] == [str(p) for p in result["agents"]]
    assert config["parameters"] == {"r": 0.1, "alpha": 2.0}
    for path in (result["base"], *result["agents"]):
        assert Path(path).is_absolute() and (path / "model.safetensors").is_file()
    base = load_dir(result["base"])
    for path, density in zip(result["agents"], (0.03, 0.46, 0.54), strict=True):
        assert abs(fraction(changed(base, load_dir(path))) - density) < 0.015
