"""The streaming engine against the in-memory reference implementations, on RL-like checkpoints.

Inputs are Qwen2-shaped bf16 checkpoints in several shards with sparse, heterogeneous, partly overlapping task
vectors (densities 3%, 46%, 54%). Merges run with a tiny chunk budget so most tensors are processed in many row
chunks, and every output is reloaded with transformers.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import ram_trl
import ram_trl.merging.engine
import ram_trl.merging.streaming
import ram_trl.methods.ties
import ram_trl.parallel
import ram_trl.statistics.counting
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from tests import reference

CHUNK_BUDGET = 64 * 1024  # forces row chunking of every matrix


@pytest.fixture(scope="module")
def rl_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rl")
    base = make_base_checkpoint(
        root / "base", hidden_size=32, num_layers=2, intermediate_size=64, max_shard_size="40KB"
    )
    agents = make_agent_set(base, root, densities=(0.03, 0.46, 0.54), overlap=0.5, seed=11)
    state = {"base": reference.load_state_dict(base), "agents": [reference.load_state_dict(a) for a in agents]}
    return root, base, agents, state


def _config(base, agents, method, params=None, agent_params=None, **extra):
    return {
        "merge_method": method,
        "base_model": str(base),
        "models": [
            {"model": str(a), "parameters": (agent_params[i] if agent_params else {})} for i, a in enumerate(agents)
        ],
        "parameters": params or {},
        **extra,
    }


def _assert_matches(out_dir, expected: dict[str, torch.Tensor], base_state, out_dtype=None):
    merged = reference.load_state_dict(out_dir)
    assert set(merged) == set(base_state)
    changed = 0
    for name, value in expected.items():
        dtype = out_dtype or base_state[name].dtype
        want = value.to(dtype)
        assert merged[name].dtype == dtype, name
        assert torch.equal(merged[name], want), f"{name}: max diff {(merged[name].float() - want.float()).abs().max()}"
        changed += int((merged[name] != base_state[name].to(dtype)).sum())
    assert changed > 0  # the merge did something


def test_inputs_are_rl_like(rl_checkpoints):
    _, _, _, state = rl_checkpoints
    base = state["base"]
    densities = []
    for agent in state["agents"]:
        active = total = 0
        for name, value in base.items():
            active += int(((agent[name].float() - value.float()).abs() > 1e-5).sum())
            total += value.numel()
        densities.append(active / total)
    assert densities[0] < 0.05 and 0.35 < densities[1] < 0.5 and 0.4 < densities[2] < 0.6
    assert any(v.dtype == torch.bfloat16 for v in base.values())


@pytest.mark.parametrize(
    ("method", "params", "kwargs"),
    [
        ("ram", {}, {}),
        ("ram_plus", {"r": 0.1, "alpha": 2.0}, {"r": 0.1, "alpha": 2.0}),
        ("ram_plus", {"r": 0.2, "alpha": 0.5}, {"r": 0.2, "alpha": 0.5}),
        ("ram_plus_soft", {"r": 0.1}, {"r": 0.1, "soft": True}),
        ("ram_plus", {"r": 0.1, "alpha": 0.2, "rho_scope": "tensor"}, {"r": 0.1, "alpha": 0.2, "scope": "tensor"}),
    ],
)
def test_ram_family_matches_reference(rl_checkpoints, tmp_path, method, params, kwargs):
    _, base, agents, state = rl_checkpoints
    report = ram_trl.merge(
        _config(base, agents, method, params), tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False
    )
    expected, stats = reference.ram_reference(state["base"], state["agents"], **kwargs)
    _assert_matches(tmp_path / "out", expected, state["base"])
    assert [a["unique"] for a in report["agents"]] == stats["unique"]
    assert [a["shared"] for a in report["agents"]] == stats["shared"]
    if kwargs.get("scope", "global") == "global" and method != "ram":
        assert [a["lambda"] for a in report["agents"]] == pytest.approx(stats["lambdas"], abs=0)


def test_float32_output_matches_reference_exactly(rl_checkpoints, tmp_path):
    _, base, agents, state = rl_checkpoints
    config = _config(base, agents, "ram_plus", {"r": 0.1}, out_dtype="float32")
    ram_trl.merge(config, tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False)
    expected, _ = reference.ram_reference(state["base"], state["agents"], r=0.1, alpha=2.0)
    _assert_matches(tmp_path / "out", expected, state["base"], out_dtype=torch.float32)


def test_task_arithmetic_matches_reference(rl_checkpoints, tmp_path):
    _, base, agents, state = rl_checkpoints
    weights = [0.5, 0.3, 0.2]
    config = _config(base, agents, "task_arithmetic", {"lambda": 0.8}, [{"weight": w} for w in weights])
    ram_trl.merge(config, tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False)
    expected = reference.task_arithmetic_reference(state["base"], state["agents"], weights, lam=0.8)
    _assert_matches(tmp_path / "out", expected, state["base"])


@pytest.mark.parametrize("normalize", [True, False])
def test_ties_matches_reference(rl_checkpoints, tmp_path, normalize):
    _, base, agents, state = rl_checkpoints
    weights, densities = [1.0, 0.7, 0.4], [0.2, 0.29, 0.1]
    config = _config(
        base,
        agents,
        "ties",
        {"lambda": 0.9, "normalize": normalize},
        [{"weight": w, "density": d} for w, d in zip(weights, densities, strict=True)],
    )
    ram_trl.merge(config, tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False)
    expected = reference.ties_reference(
        state["base"], state["agents"], weights, densities, lam=0.9, normalize=normalize
    )
    _assert_matches(tmp_path / "out", expected, state["base"])


@pytest.mark.parametrize(("method", "ties"), [("dare_linear", False), ("dare_ties", True)])
def test_dare_matches_reference_and_ignores_chunking(rl_checkpoints, tmp_path, method, ties):
    _, base, agents, state = rl_checkpoints
    weights, densities = [1.0, 0.5, 0.5], [0.5, 0.3, 0.9]
    config = _config(
        base, agents, method, {}, [{"weight": w, "density": d} for w, d in zip(weights, densities, strict=True)]
    )
    config["seed"] = 5
    ram_trl.merge(config, tmp_path / "small", chunk_budget=CHUNK_BUDGET, progress=False)
    ram_trl.merge(config, tmp_path / "whole", progress=False)
    expected = reference.dare_reference(state["base"], state["agents"], weights, densities, seed=5, ties=ties)
    _assert_matches(tmp_path / "small", expected, state["base"])
    _assert_matches(tmp_path / "whole", expected, state["base"])


def test_linear_matches_reference(rl_checkpoints, tmp_path):
    _, base, agents, state = rl_checkpoints
    weights = [2.0, 1.0, 1.0]
    config = _config(base, agents, "linear", {}, [{"weight": w} for w in weights])
    ram_trl.merge(config, tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False)
    expected = reference.linear_reference(state["base"], state["agents"], weights)
    _assert_matches(tmp_path / "out", expected, state["base"])


def test_output_is_sharded_and_reloads_with_transformers(rl_checkpoints, tmp_path):
    _, base, agents, _ = rl_checkpoints
    out = tmp_path / "out"
    ram_trl.merge(_config(base, agents, "ram_plus"), out, max_shard_size="30KB", progress=False)
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(out)
    inputs = tokenizer("12+3=", return_tensors="pt")
    generated = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == inputs["input_ids"].shape[1] + 4
    reference_model = AutoModelForCausalLM.from_pretrained(base)
    merged_state, base_state = model.state_dict(), reference_model.state_dict()
    assert set(merged_state) == set(base_state)
    assert any(not torch.equal(merged_state[k], base_state[k]) for k in base_state)


def test_same_result_for_any_chunk_budget_and_shard_size(rl_checkpoints, tmp_path):
    _, base, agents, _ = rl_checkpoints
    config = _config(base, agents, "ties", {}, [{"density": 0.3}] * 3)
    ram_trl.merge(config, tmp_path / "a", chunk_budget=CHUNK_BUDGET, max_shard_size="20KB", progress=False)
    ram_trl.merge(config, tmp_path / "b", progress=False)
    a, b = reference.load_state_dict(tmp_path / "a"), reference.load_state_dict(tmp_path / "b")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def tiny_blocks(monkeypatch):
    """Compute blocks of a few rows on two threads (a thread plan for two cores: every chunk splits into many blocks
    merged in parallel) and TIES cut histograms over many blocks."""
    monkeypatch.setattr(ram_trl.merging.streaming, "COMPUTE_BLOCK_ELEMENTS", 100)
    monkeypatch.setattr(ram_trl.merging.streaming, "STATISTICS_BLOCK_ELEMENTS", 100)
    monkeypatch.setattr(ram_trl.methods.ties, "HISTOGRAM_BLOCK", 100)
    monkeypatch.setattr(ram_trl.statistics.counting, "HISTOGRAM_BLOCK", 100)
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ram_trl.parallel, "available_cores", lambda: 2)
    assert ram_trl.parallel.plan_threads().compute == 2


@pytest.mark.parametrize("chunk_budget", [CHUNK_BUDGET, "256MB"])
@pytest.mark.parametrize("method", ["ram_plus", "ties", "dare_ties", "task_arithmetic"])
def test_blocks_on_threads_match_reference(rl_checkpoints, tmp_path, tiny_blocks, method, chunk_budget):
    _, base, agents, state = rl_checkpoints
    weights, densities = [1.0, 0.7, 0.4], [0.2, 0.29, 0.1]
    agent_params = [{"weight": w, "density": d} for w, d in zip(weights, densities, strict=True)]
    if method == "ram_plus":
        config = _config(base, agents, method, {"r": 0.1, "alpha": 2.0})
        expected, _ = reference.ram_reference(state["base"], state["agents"], r=0.1, alpha=2.0)
    elif method == "ties":
        config = _config(base, agents, method, {"lambda": 0.9}, agent_params)
        expected = reference.ties_reference(state["base"], state["agents"], weights, densities, lam=0.9)
    elif method == "dare_ties":
        config = {**_config(base, agents, method, {}, agent_params), "seed": 5}
        expected = reference.dare_reference(state["base"], state["agents"], weights, densities, seed=5, ties=True)
    else:
        config = _config(base, agents, method, {"lambda": 0.8}, [{"weight": w} for w in weights])
        expected = reference.task_arithmetic_reference(state["base"], state["agents"], weights, lam=0.8)
    report = ram_trl.merge(config, tmp_path / "out", chunk_budget=chunk_budget, progress=False)
    _assert_matches(tmp_path / "out", expected, state["base"])
    if method == "ram_plus":
        _, stats = reference.ram_reference(state["base"], state["agents"], r=0.1, alpha=2.0)
        assert [a["unique"] for a in report["agents"]] == stats["unique"]
        assert [a["shared"] for a in report["agents"]] == stats["shared"]


# ---------------------------------------------------------------------------------------------------------------
# The mechanism merges (issue 32, the paper's Fig. 3 question)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_ram_unique_scale_matches_reference(rl_checkpoints, tmp_path, out_dtype):
    _, base, agents, state = rl_checkpoints
    scale = 1 / 3
    extra = {"out_dtype": "float32"} if out_dtype else {}
    report = ram_trl.merge(
        _config(base, agents, "ram", {"unique_scale": scale}, **extra),
        tmp_path / "out",
        chunk_budget=CHUNK_BUDGET,
        progress=False,
    )
    expected, _ = reference.ram_reference(state["base"], state["agents"], unique_scale=scale)
    _assert_matches(tmp_path / "out", expected, state["base"], out_dtype=out_dtype)
    # the step's written elements: where the written merge differs from plain RAM's, written in the same dtype
    plain, _ = reference.ram_reference(state["base"], state["agents"])
    differ = sum(
        int(
            (
                expected[n].to(out_dtype or state["base"][n].dtype) != plain[n].to(out_dtype or state["base"][n].dtype)
            ).sum()
        )
        for n in expected
    )
    assert report["effect"]["step_written"] == differ > 0


@pytest.mark.parametrize("agent", [0, 1, 2])
def test_ram_unique_matches_reference(rl_checkpoints, tmp_path, agent):
    _, base, agents, state = rl_checkpoints
    config = _config(base, agents, "ram_unique", {"agent": agents[agent].name})
    report = ram_trl.merge(config, tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False)
    expected = reference.ram_unique_reference(state["base"], state["agents"], agent)
    _assert_matches(tmp_path / "out", expected, state["base"])
    assert report["agents"][agent]["unique"] > 0


def test_ties_at_density_one_matches_reference(rl_checkpoints, tmp_path):
    _, base, agents, state = rl_checkpoints
    ram_trl.merge(
        _config(base, agents, "ties", {"density": 1.0}), tmp_path / "out", chunk_budget=CHUNK_BUDGET, progress=False
    )
    expected = reference.ties_reference(state["base"], state["agents"], [1.0] * 3, [1.0] * 3)
    _assert_matches(tmp_path / "out", expected, state["base"])
