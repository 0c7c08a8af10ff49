"""ram_trl/validation.py: the shared input checks, each error naming the place and what to change (the checks as
the CLI, configs and checkpoints reach them are in tests/test_bad_input.py and tests/test_hostile_inputs.py)."""

from __future__ import annotations

import os

import pytest
import torch

from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.validation import (
    FLOAT32_MAX,
    check_device,
    check_number,
    check_optional_number,
    check_reward_values,
    check_weight_sums,
    confine,
    is_vocabulary_tensor,
)

WHERE = "merge.yaml: models[1] (./coder)"


def test_numbers_within_bounds_become_floats():
    assert check_number(3, WHERE, "weight") == 3.0
    assert type(check_number(3, WHERE, "weight")) is float
    assert check_number(0.0, WHERE, "density", minimum=0.0, maximum=1.0) == 0.0
    assert check_number(1.0, WHERE, "density", minimum=0.0, maximum=1.0) == 1.0
    assert check_number(FLOAT32_MAX, WHERE, "lambda") == FLOAT32_MAX
    assert check_number(4.0, WHERE, "rank", integer=True) == 4.0
    assert check_optional_number(None, WHERE, "r", minimum=0.0) is None
    assert check_optional_number(2, WHERE, "r", minimum=0.0) == 2.0


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (True, {}, "weight must be a number, got True"),
        ("1", {}, "weight must be a number, got '1'"),
        (float("nan"), {}, "weight must be a finite number, got nan"),
        (1e39, {}, "weight is 1e+39, beyond float32"),
        (2.5, {"integer": True}, "weight must be a whole number, got 2.5"),
        (-0.5, {"minimum": 0.0}, "weight must be >= 0.0, got -0.5"),
        (1.5, {"maximum": 1.0}, "weight must be <= 1.0, got 1.5"),
        (0.0, {"above": 0.0}, "weight must be > 0.0, got 0.0"),
    ],
)
def test_bad_numbers_name_the_place_and_field(value, bounds, message):
    with pytest.raises(ConfigError) as info:
        check_number(value, WHERE, "weight", **bounds)
    assert str(info.value).startswith(f"{WHERE}: {message}")


def test_reward_values():
    assert check_reward_values((1, None, 0.5), 3, "f") == [1.0, None, 0.5]
    with pytest.raises(ConfigError, match="^f returned str; return a list"):
        check_reward_values("0.5", 1, "f")
    with pytest.raises(ConfigError, match="^f returned 2 values for 3 completions"):
        check_reward_values([1.0, 2.0], 3, "f")
    with pytest.raises(ConfigError, match="^f"):
        check_reward_values([float("inf")], 1, "f")


def test_weight_sums():
    check_weight_sums({"a": 1.0, "b": -2.0, "c": 1e-8}, "m.yaml", "linear")
    for bad in (0.0, 5e-9, float("nan"), float("inf")):
        with pytest.raises(
            ConfigError, match=r"^m.yaml: linear with normalize: the agents' weights for tensor 'b'"
        ):
            check_weight_sums({"a": 1.0, "b": bad}, "m.yaml", "linear")


def test_devices():
    assert check_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "gpu", "", None):
        with pytest.raises(ConfigError, match="unknown device; use cpu, cuda or cuda:N"):
            check_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device is available"):
            check_device("cuda")


def test_confine(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    inside = root / "model-00001.safetensors"
    assert confine(inside, root, "index") == inside
    outside = tmp_path / "elsewhere.safetensors"
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        confine(outside, root, "index")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        confine(root / ".." / "elsewhere.safetensors", root, "index")
    assert confine(outside, root, "index", allow_external=True) == outside
    link = root / "link.safetensors"
    os.symlink(outside, link)
    with pytest.raises(CheckpointError, match=f"which resolves to {outside}"):
        confine(link, root, "index")


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
