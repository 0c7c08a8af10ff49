"""Config parsing and resolution: mergekit field names, aliases, defaults, filter rules, paths."""

from __future__ import annotations

import json
import re

import pytest
import torch
import yaml
from safetensors.torch import save_file

from ram_trl.errors import ConfigError
from ram_trl.io.vocabulary import UnionRows
from ram_trl.merging.config.resolve import resolve_config
from ram_trl.merging.config.schema import load_config


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
    resolved = _resolve(dirs, "merge_method: ramplus_tl\nbase_model: base\nmodels: [{model: a}, {model: b}]\n")
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
    assert star.agent_value(star.agents[0], "density", "lm_head.weight") == 0.3  # mergekit: '*' matches everything


def _layered(dirs, layers=5):
    for name in ("base", "a", "b"):
        (dirs / name / "config.json").write_text(json.dumps({"num_hidden_layers": layers}))
    return dirs


def _layer(i, part="mlp.up_proj"):
    return f"model.layers.{i}.{part}.weight"


def test_gradient_interpolates_over_the_layers_as_mergekit(dirs):
    """Golden values, by hand: 3 anchors over 5 layers sit at t = 0, 0.5, 1; layer i has t = i / 4."""
    resolved = _resolve(
        _layered(dirs),
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: [0.2, 1.0, 0.4]}}]\n",
    )
    agent = resolved.agents[0]
    values = [resolved.agent_value(agent, "density", _layer(i)) for i in range(5)]
    assert values == pytest.approx([0.2, 0.6, 1.0, 0.7, 0.4], abs=1e-15)
    # tensors outside the decoder layers take t = 0: the first anchor
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert resolved.agent_value(agent, "density", name) == 0.2
    assert resolved.num_layers == 5


def test_gradient_of_one_layer_takes_the_last_anchor(dirs):
    resolved = _resolve(
        _layered(dirs, layers=1),
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {weight: [0.25, 0.5, 0.75]}}]\n",
    )
    assert resolved.agent_value(resolved.agents[0], "weight", _layer(0)) == 0.75
    assert resolved.agent_value(resolved.agents[0], "weight", "lm_head.weight") == 0.25


def test_gradients_inside_filter_rules_and_global_parameters(dirs):
    resolved = _resolve(
        _layered(dirs),
        """
merge_method: slerp
base_model: base
models: [{model: base}, {model: a}]
parameters:
  t:
    - {filter: self_attn, value: [0, 0.5, 0.3, 0.7, 1]}
    - {filter: mlp, value: [1, 0.5, 0.7, 0.3, 0]}
    - value: 0.5
""",
    )
    attn = [resolved.params_for(_layer(i, "self_attn.q_proj"))["t"] for i in range(5)]
    mlp = [resolved.params_for(_layer(i))["t"] for i in range(5)]
    assert attn == [0.0, 0.5, 0.3, 0.7, 1.0]
    assert mlp == [1.0, 0.5, 0.7, 0.3, 0.0]
    assert resolved.params_for("model.norm.weight")["t"] == 0.5
    lam = _resolve(
        _layered(dirs),
        "merge_method: task_arithmetic\nbase_model: base\nmodels: [{model: a}]\nparameters: {lambda: [1.0, 0.0]}\n",
    )
    assert [lam.params_for(_layer(i))["lambda"] for i in range(5)] == [1.0, 0.75, 0.5, 0.25, 0.0]


def test_filter_rules_fall_through_to_the_global_setting_then_the_default(dirs):
    """mergekit: a model's rule list that matches no rule gives way to the global setting, then the default."""
    resolved = _resolve(
        _layered(dirs),
        """
merge_method: ties
base_model: base
parameters: {density: [{filter: mlp, value: 0.3}]}
models:
  - model: a
    parameters: {density: [{filter: self_attn, value: 0.9}]}
""",
    )
    agent = resolved.agents[0]
    assert resolved.agent_value(agent, "density", _layer(0, "self_attn.q_proj")) == 0.9
    assert resolved.agent_value(agent, "density", _layer(0)) == 0.3
    assert resolved.agent_value(agent, "density", "model.norm.weight") == 1.0  # ram_trl's density default


def test_gradient_refusals_are_one_line(dirs):
    with pytest.raises(ConfigError, match="no config.json with num_hidden_layers"):
        _resolve(
            dirs, "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: [0.1, 0.5]}}]\n"
        )
    with pytest.raises(ConfigError, match="parameter 'r' takes one value for the whole merge") as info:
        _resolve(
            _layered(dirs),
            "merge_method: ram_plus\nbase_model: base\nmodels: [{model: a}]\nparameters: {r: [0.1, 0.2]}\n",
        )
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="density' gradient: parameter 'density' must be <= 1.0"):
        _resolve(
            _layered(dirs),
            "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: [{filter: mlp, value: [0.1, 1.5]}, {value: 1}]}}]\n",
        )


def test_parameters_the_method_does_not_use_warn_once(dirs):
    text = "merge_method: ram\nbase_model: base\nparameters: {embed_slerp: true}\nmodels: [{model: a, parameters: {weight: 0.6}}, {model: b, parameters: {weight: 0.4, density: 0.5}}]\n"
    with pytest.warns(UserWarning) as caught:
        resolved = _resolve(dirs, text)
    messages = [str(w.message) for w in caught if "does not use" in str(w.message)]
    assert len(messages) == 1
    assert "'weight' (models[0], models[1])" in messages[0] and "'density' (models[1])" in messages[0]
    assert "'embed_slerp' (parameters)" in messages[0]
    assert messages[0] in resolved.notes
    assert [a.name for a in resolved.agents] == ["a", "b"]


def test_whole_model_slices_are_models(dirs):
    _layered(dirs, layers=4)
    as_slices = _resolve(
        dirs,
        """
merge_method: slerp
base_model: base
slices:
  - sources:
      - {model: base, layer_range: [0, 4]}
      - {model: a, layer_range: [0, 4]}
parameters: {t: 0.3}
""",
    )
    assert [a.name for a in as_slices.agents] == ["a"] and as_slices.params["t"] == 0.3
    as_modules = _resolve(
        dirs,
        """
merge_method: ties
base_model: base
modules:
  decoder:
    slices:
      - sources:
          - {model: a, layer_range: [0, 4], parameters: {weight: 0.7}}
          - {model: b, layer_range: [0, 4]}
        parameters: {density: [{filter: mlp, value: 0.2}]}
    parameters: {density: 0.6}
""",
    )
    a, b = as_modules.agents
    assert as_modules.agent_value(a, "weight", _layer(0)) == 0.7
    assert as_modules.agent_value(b, "density", _layer(0)) == 0.2
    assert as_modules.agent_value(b, "density", _layer(0, "self_attn.q_proj")) == 0.6


def test_consecutive_slices_take_their_own_settings_as_mergekit(dirs):
    """Golden values, by hand: each slice's gradient spans its own layers (mergekit's ``t`` restarts at 0 in each
    slice); the embeddings take the first slice's settings, the final norm and ``lm_head`` the last's, both at
    ``t = 0``; the source's parameter beats the slice's, which beats the top-level one."""
    _layered(dirs, layers=5)
    with pytest.warns(UserWarning, match="does not use") as caught:
        resolved = _resolve(
            dirs,
            """
merge_method: ties
base_model: base
slices:
  - sources:
      - {model: base, layer_range: [0, 2]}
      - {model: a, layer_range: [0, 2], parameters: {weight: [0.2, 0.4]}}
      - {model: b, layer_range: [0, 2]}
    parameters: {lambda: 0.5}
  - sources:
      - {model: base, layer_range: [2, 5]}
      - {model: a, layer_range: [2, 5], parameters: {weight: 0.9}}
      - {model: b, layer_range: [2, 5], parameters: {density: [0.1, 0.3]}}
    parameters: {weight: 0.7, lambda: [1.0, 2.0]}
parameters: {density: 0.6, embed_slerp: true}
""",
        )
    (message,) = [str(w.message) for w in caught if "does not use" in str(w.message)]
    assert "'embed_slerp' (parameters);" in message  # listed once, though every slice falls through to it
    a, b = resolved.agents
    assert [x.name for x in resolved.agents] == ["a", "b"]
    assert [resolved.agent_value(a, "weight", _layer(i)) for i in range(5)] == [0.2, 0.4, 0.9, 0.9, 0.9]
    assert [resolved.agent_value(b, "weight", _layer(i)) for i in range(5)] == [1.0, 1.0, 0.7, 0.7, 0.7]
    assert [resolved.agent_value(b, "density", _layer(i)) for i in range(5)] == pytest.approx(
        [0.6, 0.6, 0.1, 0.2, 0.3], abs=1e-15
    )
    assert [resolved.params_for(_layer(i))["lambda"] for i in range(5)] == [0.5, 0.5, 1.0, 1.5, 2.0]
    assert resolved.agent_value(a, "weight", "model.embed_tokens.weight") == 0.2
    assert resolved.params_for("model.embed_tokens.weight")["lambda"] == 0.5
    for name in ("model.norm.weight", "lm_head.weight"):
        assert resolved.agent_value(a, "weight", name) == 0.9
        assert resolved.agent_value(b, "density", name) == pytest.approx(0.1)
        assert resolved.params_for(name)["lambda"] == 1.0
    assert any("2 consecutive output slices (layers 0-1, 2-4)" in note for note in resolved.notes)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (
            "slices: [{sources: [{model: a, layer_range: [0, 2]}]}]",
            "layer_range [0, 2] is not the whole model (4 layers)",
        ),
        (
            "slices: [{sources: [{model: a, layer_range: [0, 2]}]}, {sources: [{model: a, layer_range: [0, 2]}]}]",
            "slices[1] takes layer_range [0, 2] after layer 2: stacking",
        ),
        (
            "slices: [{sources: [{model: a, layer_range: [0, 2]}]}, {sources: [{model: b, layer_range: [2, 4]}]}]",
            "slices[1] takes the models ['b'], slices[0] ['a']",
        ),
        (
            "slices: [{sources: [{model: a, layer_range: [0, 2]}, {model: b, layer_range: [2, 4]}]}, "
            "{sources: [{model: a, layer_range: [2, 4]}, {model: b, layer_range: [0, 2]}]}]",
            "slices[0].sources[1] (b) takes layer_range [2, 4], slices[0].sources[0] [0, 2]",
        ),
        (
            "slices: [{sources: [{model: a, layer_range: [0, 2]}]}, {sources: [{model: a, layer_range: [2, 3]}]}]",
            "slices[*].sources[0] (a): layer_range [0, 3] is not the whole model (4 layers)",
        ),
        (
            "slices: [{sources: [{model: a, layer_range: [0, 2]}]}, {sources: [{model: a, layer_range: [2, 4]}], "
            "parameters: {normalize: false}}]",
            "slices[1] and slices[0] give 'normalize' different values",
        ),
        ("modules: {a: {models: [{model: a}]}, b: {models: [{model: b}]}}", "modules lists 2 modules"),
    ],
)
def test_layer_stacking_is_refused_in_one_line(dirs, body, needle):
    _layered(dirs, layers=4)
    with pytest.raises(ConfigError, match=re.escape(needle)) as info:
        _resolve(dirs, f"merge_method: ties\nbase_model: base\n{body}\n")
    assert "\n" not in str(info.value) and "frankenmerge" not in needle


def test_passthrough_is_refused_in_one_line(dirs):
    with pytest.raises(ConfigError, match="'passthrough' is not supported: copies"):
        _resolve(dirs, "merge_method: passthrough\nmodels: [{model: a}]\n")


def test_model_plus_adapter_is_the_adapter(dirs):
    (dirs / "lora").mkdir()
    resolved = _resolve(dirs, "merge_method: ties\nbase_model: base\nmodels: [{model: base+lora}]\n")
    assert resolved.agents[0].path == dirs / "lora"
    # an adapter on another model is merged into it, as mergekit does: here no adapter to merge, one line
    with pytest.raises(
        ConfigError, match=r"models\[0\] \(a\+lora\): cannot merge the adapter .*lora into .*a \("
    ) as info:
        _resolve(dirs, "merge_method: ties\nbase_model: base\nmodels: [{model: a+lora}]\n")
    assert "\n" not in str(info.value)


def test_tokenizer_block_and_sources(dirs):
    resolved = _resolve(dirs, "merge_method: ties\nbase_model: base\nmodels: [{model: a}]\ntokenizer: {source: a}\n")
    assert resolved.tokenizer_source == dirs / "a"
    for extra, needle in [
        ("tokenizer: {source: base, tokens: {x: {source: a}}}", r"tokenizer.tokens\['x'\]: .*base has no row"),
        ("tokenizer: {source: base, tokens: {x: 1}}", r"a rule is \{source: MODEL, force: BOOL\}, got 1"),
        (
            "tokenizer: {source: base, pad_to_multiple_of: 8}",
            "pad_to_multiple_of with source .base. needs every model",
        ),
        (
            "tokenizer: {source: a, pad_to_multiple_of: 8}",
            "pad_to_multiple_of 8 is supported with source .union. or .base. only",
        ),
        (
            "tokenizer: {source: union}",
            "'union' is supported only where it re-indexes nothing.*has no readable tokenizer.json",
        ),
        ("tokenizer_source: union", "'union' is supported only where it re-indexes nothing"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            _resolve(dirs, f"merge_method: ties\nbase_model: base\nmodels: [{{model: a}}]\n{extra}\n")


def test_chat_template_names_literals_and_auto(dirs):
    def template(value):
        config = {"merge_method": "ties", "base_model": str(dirs / "base"), "models": [{"model": str(dirs / "a")}]}
        return resolve_config(*load_config({**config, "chat_template": value})).chat_template

    # auto with no template among the inputs sets none, as mergekit 0.1.5 does (it used to be refused)
    assert template("auto") is None
    pytest.importorskip("mergekit")
    assert template("chatml").startswith("{% for message in messages %}{{'<|im_start|>'")
    literal = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert template(literal) == literal
    (dirs / "a" / "chat_template.jinja").write_text(literal + "\n")
    assert template("auto") == literal
    with pytest.raises(ConfigError, match="neither a known template name nor a Jinja template"):
        template("no-such-template")


def test_a_chat_template_that_does_not_compile_is_refused_naming_its_origin(dirs):
    def template(value):
        config = {"merge_method": "ties", "base_model": str(dirs / "base"), "models": [{"model": str(dirs / "a")}]}
        return resolve_config(*load_config({**config, "chat_template": value})).chat_template

    broken = "{% for m in messages %}{{ m['content'] }}"  # no endfor
    with pytest.raises(ConfigError) as exc:
        template(broken)
    message = str(exc.value)
    assert "\n" not in message and "chat_template" in message and "the config's text" in message, message
    assert "does not compile at line 1" in message and "endfor" in message, message
    (dirs / "a" / "chat_template.jinja").write_text("{{ messages[0]['content'] }\n")
    with pytest.raises(ConfigError, match=r"from 'auto' \(.*a\) does not compile"):
        template("auto")
    generation = "{% for m in messages %}{% generation %}{{ m['content'] | tojson }}{% endgeneration %}{% endfor %}"
    assert template(generation) == generation  # transformers' own tags and filters compile


def test_bad_dtype_and_choice(dirs):
    with pytest.raises(ConfigError, match="unknown dtype"):
        _resolve(dirs, "merge_method: ram\nbase_model: base\nmodels: [{model: a}]\nout_dtype: int3\n")
    with pytest.raises(ConfigError, match="rho_scope"):
        _resolve(
            dirs, "merge_method: ram_plus\nbase_model: base\nmodels: [{model: a}]\nparameters: {rho_scope: layer}\n"
        )


def test_dict_config_round_trip(dirs):
    data = yaml.safe_load(f"merge_method: linear\nbase_model: {dirs / 'base'}\nmodels: [{{model: {dirs / 'a'}}}]\n")
    resolved = resolve_config(*load_config(data))
    assert resolved.method.name == "linear"
    assert resolved.raw["merge_method"] == "linear"


def test_numbers_written_as_strings_are_numbers_as_in_mergekit(dirs):
    resolved = _resolve(
        dirs,
        "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: '0.5'}}]\nparameters: {lambda: 1e-1}\n",
    )
    assert resolved.agents[0].parameters["density"] == 0.5 and resolved.params["lambda"] == 0.1
    with pytest.raises(ConfigError, match="parameter 'density' must be a number, got 'half'"):
        _resolve(dirs, "merge_method: ties\nbase_model: base\nmodels: [{model: a, parameters: {density: half}}]\n")


def _tokenizer(path, tokens):
    vocab = {token: i for i, token in enumerate(tokens)}
    (path / "tokenizer.json").write_text(
        json.dumps({"model": {"type": "WordLevel", "vocab": vocab}, "added_tokens": []})
    )


def test_an_explicit_tokenizer_keeps_the_base_rows_only_when_every_model_numbers_its_tokens_alike(dirs):
    """mergekit re-indexes each model's vocabulary rows to the config's tokenizer; ram_trl follows when that is the
    identity on the base's rows (an agent's added tokens come after them), and refuses the shape mismatch otherwise."""
    for name in ("base", "a", "b"):
        (dirs / name / "config.json").write_text(json.dumps({"vocab_size": 3}))
    _tokenizer(dirs / "base", ["x", "y", "z"])
    _tokenizer(dirs / "a", ["x", "y", "z", "<|im_end|>"])
    _tokenizer(dirs / "b", ["x", "y", "z"])
    text = "merge_method: ties\nbase_model: base\nmodels: [{model: a}, {model: b}]\n"
    assert _resolve(dirs, text + "tokenizer_source: base\n").shape_mismatch == "tokenizer_rows"
    assert _resolve(dirs, text).shape_mismatch == "error"  # no tokenizer named: mergekit does not re-index either
    _tokenizer(dirs / "b", ["y", "x", "z"])  # another numbering
    assert _resolve(dirs, text + "tokenizer_source: base\n").shape_mismatch == "error"
    _tokenizer(dirs / "b", ["x", "y", "z"])
    assert _resolve(dirs, text + "tokenizer_source: a\n").shape_mismatch == "error"  # token 3 has no base row


def test_union_without_reindexing_takes_the_tokenizer_that_holds_every_used_token(dirs):
    rows = {"base": 3, "a": 4, "b": 3}
    for name, count in rows.items():
        (dirs / name / "config.json").write_text(json.dumps({"vocab_size": count}))
    _tokenizer(dirs / "base", ["x", "y", "z"])
    _tokenizer(dirs / "a", ["x", "y", "z", "<|im_end|>"])
    _tokenizer(dirs / "b", ["x", "y", "z", "<unused>"])  # its token 3 has no row: not in the union
    text = (
        "merge_method: task_arithmetic\nbase_model: base\nmodels: [{model: a}, {model: b}]\ntokenizer_source: union\n"
    )
    resolved = _resolve(dirs, text)
    assert resolved.tokenizer_source == dirs / "a" and resolved.shape_mismatch == "merge_common_rows"
    _tokenizer(dirs / "b", ["y", "x", "z"])  # another numbering: the union would re-index rows
    with pytest.raises(ConfigError, match="'union' is supported only where it re-indexes nothing"):
        _resolve(dirs, text)
    _tokenizer(dirs / "b", ["x", "y", "z"])
    # a whole-tensor step: every model gets the union's rows before the merge (b and the base: a's row 3)
    resolved = _resolve(dirs, text.replace("task_arithmetic", "ties"))
    assert resolved.union_rows == UnionRows(4, {3: (1,)}) and resolved.shape_mismatch == "error"
    # a token two models add: their rows are merged from the holders' mean, whatever the method
    _tokenizer(dirs / "b", ["x", "y", "z", "<|im_end|>"])
    (dirs / "b" / "config.json").write_text(json.dumps({"vocab_size": 4}))
    assert _resolve(dirs, text).union_rows == UnionRows(4, {3: (1, 2)})
    with pytest.raises(ConfigError, match="'union' with fisher is not supported here"):
        _resolve(dirs, text.replace("task_arithmetic", "fisher"))


def test_union_leaves_out_embedding_rows_that_are_no_token(dirs):
    """An agent's embedding padded past its tokenizer (5 rows, 4 tokens): the union has 4 rows, built before the
    merge, so the spare row is in no merged row and the output has 4 rows, as mergekit writes it."""
    for name, count in {"base": 3, "a": 5}.items():
        (dirs / name / "config.json").write_text(json.dumps({"vocab_size": count}))
    _tokenizer(dirs / "base", ["x", "y", "z"])
    _tokenizer(dirs / "a", ["x", "y", "z", "<|im_end|>"])
    text = "merge_method: task_arithmetic\nbase_model: base\nmodels: [{model: a}]\ntokenizer_source: union\n"
    resolved = _resolve(dirs, text)
    assert resolved.union_rows == UnionRows(4, {3: (1,)}) and resolved.shape_mismatch == "error"
    assert any("has 1 embedding row(s) that are no token of its tokenizer (first: 4)" in n for n in resolved.notes)
    with pytest.raises(ConfigError, match="with fisher is not supported here.*no token of its tokenizer"):
        _resolve(dirs, text.replace("task_arithmetic", "fisher"))


def test_empty_parameters_of_a_slice_mean_none(dirs):
    for name in ("base", "a"):
        (dirs / name / "config.json").write_text(json.dumps({"num_hidden_layers": 2}))
    resolved = _resolve(
        dirs,
        "merge_method: ties\nbase_model: base\nslices:\n  - sources:\n      - model: a\n        layer_range: [0, 2]\n"
        "        parameters:\n    parameters:\n",
    )
    assert resolved.agents[0].parameters["density"] == 1.0
