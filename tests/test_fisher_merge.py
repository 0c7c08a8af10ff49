"""Fisher merging through the streaming engine: equal to the in-memory reference, chunked, with bad inputs refused.

Inputs are Qwen2-shaped bf16 checkpoints in several shards with sparse, overlapping task vectors and random
non-negative float32 Fishers with exact zeros (so the zero-denominator branch runs when the floor is off).
"""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import ram_trl
import ram_trl.merging.streaming
from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError
from ram_trl.io.checkpoint import FISHER_FILE
from ram_trl.merging.planner import bytes_per_element
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from tests import reference
from tests.helpers import random_fisher

CHUNK_BUDGET = 64 * 1024  # forces row chunking of every matrix


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fisher")
    base = make_base_checkpoint(
        root / "base", hidden_size=32, num_layers=2, intermediate_size=64, max_shard_size="40KB"
    )
    agents = make_agent_set(base, root, densities=(0.03, 0.46, 0.54), overlap=0.5, seed=11)
    base_state = reference.load_state_dict(base)
    fishers = []
    for i, agent in enumerate(agents):
        fisher = random_fisher(base_state, seed=100 + i)
        save_file(fisher, str(agent / FISHER_FILE))
        fishers.append(fisher)
    state = {"base": base_state, "agents": [reference.load_state_dict(a) for a in agents], "fishers": fishers}
    return root, base, agents, state


def _config(base, agents, params=None, agent_params=None):
    return {
        "merge_method": "fisher",
        "base_model": str(base),
        "models": [
            {"model": str(a), "parameters": (agent_params[i] if agent_params else {})} for i, a in enumerate(agents)
        ],
        "parameters": params or {},
    }


def _assert_equal(out_dir, expected, base_state):
    merged = reference.load_state_dict(out_dir)
    assert set(merged) == set(base_state)
    changed = 0
    for name, value in expected.items():
        want = value.to(base_state[name].dtype)
        assert merged[name].dtype == want.dtype, name
        assert torch.equal(merged[name], want), f"{name}: max diff {(merged[name].float() - want.float()).abs().max()}"
        changed += int((merged[name] != base_state[name]).sum())
    assert changed > 0


@pytest.mark.parametrize(
    ("params", "weights", "floor"),
    [
        ({}, [1.0, 1.0, 1.0], 1e-6),
        ({"lambda": 0.7, "fisher_floor": 0.0}, [1.0, 0.5, 2.0], 0.0),
        ({"fisher_floor": 1e-3}, [0.2, 0.3, 0.5], 1e-3),
    ],
)
def test_streaming_equals_reference(inputs, tmp_path, params, weights, floor):
    _, base, agents, state = inputs
    config = _config(base, agents, params, [{"weight": w} for w in weights])
    report = ram_trl.merge(config, tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False)
    expected = reference.fisher_reference(
        state["base"], state["agents"], state["fishers"], weights, lam=params.get("lambda", 1.0), floor=floor
    )
    _assert_equal(tmp_path / "out", expected, state["base"])
    assert report["merge_method"] == "fisher"
    assert [a["parameters"]["fisher"] for a in report["agents"]] == [str(a / FISHER_FILE) for a in agents]
    assert report["bytes_read"] > sum((a / FISHER_FILE).stat().st_size for a in agents)
    card = (tmp_path / "out" / "README.md").read_text()
    assert all(f"- `{a.name}`: `{a / FISHER_FILE}`" in card for a in agents)


def test_blocks_on_threads_equal_reference(inputs, tmp_path, monkeypatch):
    """Chunks split into compute blocks of a few rows merged on two threads: each block gets its own Fisher rows."""
    monkeypatch.setattr(ram_trl.merging.streaming, "COMPUTE_BLOCK_ELEMENTS", 100)
    monkeypatch.setattr(ram_trl.merging.streaming, "STATISTICS_BLOCK_ELEMENTS", 100)
    _, base, agents, state = inputs
    weights = [1.0, 0.5, 2.0]
    config = _config(base, agents, {"lambda": 0.7}, [{"weight": w} for w in weights])
    for budget in (CHUNK_BUDGET, "256MB"):
        out = tmp_path / f"out-{budget}"
        ram_trl.merge(config, out, chunk_budget=budget, progress=False)
        expected = reference.fisher_reference(
            state["base"], state["agents"], state["fishers"], weights, lam=0.7, floor=1e-6
        )
        _assert_equal(out, expected, state["base"])


def test_zero_denominator_branch_is_exercised(inputs):
    """The fixture's Fishers are all zero on some elements (so the plain-mean rule is compared above)."""
    _, _, _, state = inputs
    name = "model.layers.0.mlp.up_proj.weight"
    all_zero = sum((f[name] == 0).int() for f in state["fishers"]) == len(state["fishers"])
    assert int(all_zero.sum()) > 20


def test_chunking_does_not_change_the_result(inputs, tmp_path):
    _, base, agents, _ = inputs
    config = _config(base, agents, {"fisher_floor": 0.0})
    ram_trl.merge(config, tmp_path / "small", chunk_budget=CHUNK_BUDGET, max_shard_size="20KB", progress=False)
    ram_trl.merge(config, tmp_path / "whole", progress=False)
    a, b = reference.load_state_dict(tmp_path / "small"), reference.load_state_dict(tmp_path / "whole")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_equal_fishers_reduce_to_weighted_average(inputs, tmp_path):
    """With the same Fisher for every agent the merge is the weighted mean of the task vectors (linear merging)."""
    root, base, agents, state = inputs
    shared = tmp_path / "shared.safetensors"
    save_file(random_fisher(state["base"], seed=7, zero_share=0.0), str(shared))
    weights = [1.0, 2.0, 1.0]
    config = _config(base, agents, {"fisher_floor": 0.0}, [{"weight": w, "fisher": str(shared)} for w in weights])
    config["out_dtype"] = "float32"
    ram_trl.merge(config, tmp_path / "fisher", progress=False)
    merged = reference.load_state_dict(tmp_path / "fisher")
    linear = reference.linear_reference(state["base"], state["agents"], weights)
    for name, value in linear.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-7)


def test_output_loads_with_transformers(inputs, tmp_path):
    _, base, agents, _ = inputs
    ram_trl.merge(_config(base, agents), tmp_path / "out", progress=False)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.dtype == torch.bfloat16


def test_inputs_are_not_modified(inputs, tmp_path):
    _, base, agents, _ = inputs

    def digest():
        return {
            p: hashlib.sha256(p.read_bytes()).hexdigest()
            for d in [base, *agents]
            for p in sorted(d.iterdir())
            if p.is_file()
        }

    before = digest()
    ram_trl.merge(_config(base, agents), tmp_path / "out", progress=False)
    assert digest() == before


def test_fisher_path_parameter_is_resolved_beside_the_config(inputs, tmp_path):
    _, base, agents, state = inputs
    copies = []
    for i, agent in enumerate(agents):
        copy = tmp_path / f"f{i}.safetensors"
        shutil.copy(agent / FISHER_FILE, copy)
        copies.append(copy.name)  # relative: resolved beside the YAML
    config = _config(base, agents, {}, [{"fisher": name} for name in copies])
    path = tmp_path / "merge.yaml"
    import yaml

    path.write_text(yaml.safe_dump(config))
    ram_trl.merge(path, tmp_path / "out", progress=False)
    expected = reference.fisher_reference(state["base"], state["agents"], state["fishers"], [1.0] * 3)
    _assert_equal(tmp_path / "out", expected, state["base"])


# ---------------------------------------------------------------------------------------------------------------
# Bad inputs


@pytest.fixture
def copies(inputs, tmp_path):
    """Copies of the agents whose Fisher files a test may break."""
    _, base, agents, state = inputs
    out = []
    for agent in agents:
        target = tmp_path / agent.name
        shutil.copytree(agent, target)
        out.append(target)
    return base, out, state


def _refused(config, out, error, *fragments):
    with pytest.raises(error) as info:
        ram_trl.merge(config, out, progress=False)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if "ram-trl-tmp" in p.name]


def test_missing_fisher_file(copies, tmp_path):
    base, agents, _ = copies
    (agents[1] / FISHER_FILE).unlink()
    _refused(
        _config(base, agents), tmp_path / "out", CheckpointError, "agent 1 (agent_1)", FISHER_FILE, "ram-trl fisher"
    )


def test_missing_fisher_parameter_path(copies, tmp_path):
    base, agents, _ = copies
    config = _config(base, agents, {}, [{}, {}, {"fisher": str(tmp_path / "nowhere.safetensors")}])
    _refused(config, tmp_path / "out", CheckpointError, "agent 2", "nowhere.safetensors")


def test_missing_tensor_in_fisher(copies, tmp_path):
    base, agents, _ = copies
    fisher = load_file(str(agents[0] / FISHER_FILE))
    del fisher["model.layers.1.self_attn.k_proj.weight"]
    save_file(fisher, str(agents[0] / FISHER_FILE))
    _refused(
        _config(base, agents),
        tmp_path / "out",
        CheckpointError,
        "agent 0 (agent_0)",
        str(agents[0] / FISHER_FILE),
        "model.layers.1.self_attn.k_proj.weight",
    )


def test_shape_mismatch_in_fisher(copies, tmp_path):
    base, agents, _ = copies
    fisher = load_file(str(agents[2] / FISHER_FILE))
    name = "model.layers.0.mlp.down_proj.weight"
    fisher[name] = fisher[name][:, :-1].contiguous()
    save_file(fisher, str(agents[2] / FISHER_FILE))
    _refused(_config(base, agents), tmp_path / "out", CheckpointError, "agent 2", name, "shape", "[32, 63]")


@pytest.mark.parametrize(
    ("value", "what"), [(float("nan"), "NaN/Inf"), (float("inf"), "NaN/Inf"), (-1e-3, "negative")]
)
def test_bad_fisher_values(copies, tmp_path, value, what):
    base, agents, _ = copies
    fisher = load_file(str(agents[1] / FISHER_FILE))
    name = "model.layers.1.mlp.gate_proj.weight"
    fisher[name][5, 3] = value
    save_file(fisher, str(agents[1] / FISHER_FILE))
    _refused(
        _config(base, agents),
        tmp_path / "out",
        NonFiniteError,
        "agent 1 (agent_1)",
        str(agents[1] / FISHER_FILE),
        name,
        what,
    )


def test_negative_weight_is_a_config_error(copies, tmp_path):
    base, agents, _ = copies
    config = _config(base, agents, {}, [{"weight": -1.0}, {}, {}])
    _refused(config, tmp_path / "out", ConfigError, "weight", ">= 0.0")


def test_plan_budgets_the_fisher_buffers():
    assert bytes_per_element(3, 2, 2, fisher_itemsize=4) == bytes_per_element(3, 2, 2) + 3 * (8 + 4)


def test_fisher_file_is_not_taken_for_weights(inputs, tmp_path):
    """A directory with non-standard weight file names: the *.safetensors fallback skips fisher.safetensors."""
    _, base, agents, state = inputs
    odd = tmp_path / "odd"
    odd.mkdir()
    save_file(state["agents"][0], str(odd / "weights.safetensors"))
    shutil.copy(agents[0] / FISHER_FILE, odd / FISHER_FILE)
    config = _config(base, [odd, *agents[1:]])
    ram_trl.merge(config, tmp_path / "out", progress=False)
    expected = reference.fisher_reference(state["base"], state["agents"], state["fishers"], [1.0] * 3)
    _assert_equal(tmp_path / "out", expected, state["base"])


def test_dry_run_plans_the_fisher_reads(inputs, tmp_path):
    _, base, agents, state = inputs
    summary = ram_trl.merge(_config(base, agents), tmp_path / "out", dry_run=True, progress=False)
    assert not (tmp_path / "out").exists()
    fisher_bytes = sum(v.numel() * v.element_size() for f in state["fishers"] for v in f.values())
    assert json.dumps(summary, default=str)  # serialisable
    without = ram_trl.merge(
        {**_config(base, agents), "merge_method": "task_arithmetic", "models": [{"model": str(a)} for a in agents]},
        tmp_path / "out",
        dry_run=True,
        progress=False,
    )
    assert summary["bytes_read"] - without["bytes_read"] == fisher_bytes


@pytest.mark.filterwarnings("ignore:.*of its elements differ from the base")
def test_resized_vocabulary_uses_the_agents_own_fisher_shape(tmp_path):
    """An agent with 2 extra embedding rows may store its Fisher with its own shape; the base rows are Fisher-merged,
    the extra rows are the agent's (as for every method), and a Fisher of a third shape is refused."""
    g = torch.Generator().manual_seed(3)
    base = {"embed": torch.randn(6, 4, generator=g), "w": torch.randn(3, 4, generator=g)}
    grown = {"embed": torch.cat([base["embed"] + 0.1, torch.randn(2, 4, generator=g)]), "w": base["w"] - 0.2}
    other = {"embed": base["embed"] - 0.3, "w": base["w"] + 0.4}
    fishers = [
        {"embed": torch.rand(8, 4, generator=g), "w": torch.rand(3, 4, generator=g)},
        {"embed": torch.rand(6, 4, generator=g), "w": torch.rand(3, 4, generator=g)},
    ]
    for name, tensors, fisher in [("base", base, None), ("grown", grown, fishers[0]), ("other", other, fishers[1])]:
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"))
        if fisher is not None:
            save_file(fisher, str(tmp_path / name / FISHER_FILE))
    config = {
        **_config(tmp_path / "base", [tmp_path / "grown", tmp_path / "other"]),
        "shape_mismatch": "merge_common_rows",
    }
    with pytest.warns(UserWarning, match="config.json"):
        ram_trl.merge(config, tmp_path / "out", progress=False)
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    truncated = [{"embed": fishers[0]["embed"][:6], "w": fishers[0]["w"]}, fishers[1]]
    grown_common = {"embed": grown["embed"][:6], "w": grown["w"]}
    expected = reference.fisher_reference(base, [grown_common, other], truncated, [1.0, 1.0])
    assert torch.equal(merged["embed"][:6], expected["embed"])
    assert torch.equal(merged["w"], expected["w"])
    assert torch.equal(merged["embed"][6:], grown["embed"][6:])
    save_file({"embed": torch.rand(7, 4), "w": torch.rand(3, 4)}, str(tmp_path / "other" / FISHER_FILE))
    with pytest.raises(CheckpointError, match=r"agent 1 \(other\).*'embed' has shape \[7, 4\]"):
        ram_trl.merge(config, tmp_path / "out2", progress=False)
