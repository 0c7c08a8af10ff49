"""Config parsing and resolution: mergekit field names, aliases, defaults, filter rules, paths."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors.torch import save_file

from ram_trl.config import load_config, resolve_config
from ram_trl.errors import ConfigError


@pytest.fixture
def dirs(tmp_path):
    for name in ("base", "a", "b"):
        (tmp_path / name).mkdir()
        save_file({"w": torch.zeros(2)}, str(tmp_path / name / "model.safetensors"))
        (tmp_path / name / "config.json").write_text(json.dumps({}))
    return tmp_path


def _resolve(root, text):
    path = root / "merge.yaml"
    path.write_text(text)
    return resolve_config(*load_config(path))


def test_mergekit_ties_yaml_with_base_listed(dirs):
    resolved = _resolve(
        dirs,
        """
models:
  - model: base
  - model: a
    parameters: {density: 0.5, weight: 0.7}
  - model: b
    parameters: {density: 0.3, weight: 0.3}
merge_method: ties
base_model: base
parameters:
  normalize: true
  int8_mask: true
dtype: bfloat16
""",
    )
    # paths resolve beside the YAML file; the base listed in models is dropped (it has no task vector)
    assert [a.name for a in resolved.agents] == ["a", "b"]
    assert resolved.agents[0].parameters == {"weight": 0.7, "density": 0.5}
    assert resolved.params == {"lambda": 1.0, "normalize": True, "int8_mask": True}
    assert resolved.out_dtype == torch.bfloat16  # mergekit: output dtype = out_dtype or dtype
    assert any("base model" in note for note in resolved.notes)


def test_aliases_and_defaults(dirs):
    resolved = _resolve(
        dirs, "merge_method: ramplus_tl\nbase_model: base\nmodels: [{model: a}, {model: b}]\n"
    )
    assert resolved.method.name == "ram_plus"
    assert resolved.params == {"eps": 1e-5, "r": 0.1, "alpha": 0.2, "rho_scope": "tensor"}
    paper = _resolve(dirs, "merge_method: ram_plus\nbase_model: base\nmodels: [{model: a}, {model: b}]\n")
    assert paper.params == {"eps": 1e-5, "r": 0.1, "alpha": 2.0, "rho_scope": "global"}
    assert paper.out_dtype is None


def test_mergekit_epsilon_name_maps_to_eps(dirs):
    resolved = _resolve(
        dirs, "merge_method: ram\nbase_model: base\nmodels: [{model: a}]\nparameters: {epsilon: 0.001}\n"
    )
    assert resolved.params["eps"] == 0.001


def test_top_level_agent_parameters_are_defaults(dirs):
    resolved = _resolve(
        dirs,
        """
merge_method: task_arithmetic
base_model: base
models: [{model: a}, {model: b, parameters: {weight: 0.25}}]
parameters: {weight: 0.5, lambda: 0.9}
""",
    )
    assert [a.parameters["weight"] for a in resolved.agents] == [0.5, 0.25]


def test_filter_rules(dirs):
    resolved = _resolve(
        dirs,
        """
merge_method: ties
base_model: base
models:
  - model: a
    parameters:
      density: [{filter: self_attn, value: 0.2}, {filter: mlp, value: 0.4}, {value: 0.9}]
""",
    )
    agent = resolved.agents[0]
    assert resolved.agent_value(agent, "density", "model.layers.0.self_attn.q_proj.weight") == 0.2
    assert resolved.agent_value(agent, "density", "model.layers.0.mlp.up_proj.weight") == 0.4
    assert resolved.agent_value(agent, "density", "model.norm.weight") == 0.9
    star = _resolve(
        dirs,
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: [{filter: '*', value: 0.3}]}}]\n",
    )
    assert (
        star.agent_value(star.agents[0], "density", "lm_head.weight") == 0.3
    )  # mergekit: '*' matches everything


def test_gradient_lists_are_refused(dirs):
    with pytest.raises(ConfigError, match="gradients"):
        _resolve(
            dirs,
            "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: [0.1, 0.5]}}]\n",
        )


def test_bad_dtype_and_choice(dirs):
    with pytest.raises(ConfigError, match="unknown dtype"):
        _resolve(dirs, "merge_method: ram\nbase_model: base\nmodels: [{model: a}]\nout_dtype: int3\n")
    with pytest.raises(ConfigError, match="rho_scope"):
        _resolve(
            dirs,
            "merge_method: ram_plus\nbase_model: base\nmodels: [{model: a}]\nparameters: {rho_scope: layer}\n",
        )


def test_dict_config_round_trip(dirs):
    data = yaml.safe_load(
        f"merge_method: linear\nbase_model: {dirs / 'base'}\nmodels: [{{model: {dirs / 'a'}}}]\n"
    )
    resolved = resolve_config(*load_config(data))
    assert resolved.method.name == "linear"
    assert resolved.raw["merge_method"] == "linear"
