"""Distributed merges with real processes (torchrun / accelerate launch, gloo on CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.distributed import partition_by_bytes
from ram_trl.io.checkpoint import FISHER_FILE
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from tests.helpers import launch_merge, random_fisher

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    base = make_base_checkpoint(root / "base", hidden_size=32, num_layers=3, intermediate_size=64)
    agents = make_agent_set(base, root, densities=(0.03, 0.46, 0.54), seed=3)
    base_state = load_file(str(base / "model.safetensors"))
    for i, agent in enumerate(agents):  # for merge_method: fisher
        save_file(random_fisher(base_state, seed=i), str(agent / FISHER_FILE))
    return root, base, agents


def _write_config(root, base, agents, method, name, agent_params=None, **params):
    config = {
        "merge_method": method,
        "base_model": str(base),
        "models": [{"model": str(a), "parameters": agent_params or {}} for a in agents],
        "parameters": params,
        "seed": 1,
    }
    path = root / f"{name}.yaml"
    path.write_text(json.dumps(config))
    return path


def _files(out):
    return {p.name: p.read_bytes() for p in sorted(out.glob("*.safetensors"))}


@pytest.mark.parametrize(
    ("method", "agent_params", "params"),
    [
        ("ram_plus", None, {"r": 0.1, "alpha": 2.0}),
        ("ram_plus", None, {"rho_scope": "tensor"}),
        ("ties", {"density": 0.3}, {}),
        ("dare_ties", {"density": 0.5}, {}),
        ("fisher", {"weight": 0.5}, {"fisher_floor": 0.0, "lambda": 0.9}),
    ],
)
def test_bit_identical_for_one_two_and_three_processes(inputs, tmp_path, method, agent_params, params):
    root, base, agents = inputs
    config = _write_config(tmp_path, base, agents, method, "cfg", agent_params, **params)
    single = ram_trl.merge(config, tmp_path / "p1", max_shard_size="30KB", progress=False)
    for nproc in (2, 3):
        result = launch_merge(nproc, config, tmp_path / f"p{nproc}", "--max-shard-size", "30KB")
        assert result.returncode == 0, result.stderr[-3000:]
        assert _files(tmp_path / f"p{nproc}") == _files(tmp_path / "p1")
        assert len(_files(tmp_path / "p1")) > 1
        index = tmp_path / f"p{nproc}" / "model.safetensors.index.json"
        assert index.read_text() == (tmp_path / "p1" / "model.safetensors.index.json").read_text()
        report = json.loads((tmp_path / f"p{nproc}" / "ram_merge_report.json").read_text())
        assert report["processes"] == nproc
        for ours, theirs in zip(report["agents"], single["agents"], strict=True):
            for key in ("active", "unique", "shared", "lambda", "density", "overlap_histogram"):
                assert ours[key] == theirs[key], key


def test_two_processes_with_an_input_cache(inputs, tmp_path):
    """Each process keeps the chunks of its own share of the tensors for its merge pass: the same bytes."""
    root, base, agents = inputs
    config = _write_config(tmp_path, base, agents, "ram_plus", "cfg")
    ram_trl.merge(config, tmp_path / "p1", progress=False, input_cache="off")
    result = launch_merge(2, config, tmp_path / "p2", "--input-cache", "1GB")
    assert result.returncode == 0, result.stderr[-3000:]
    assert _files(tmp_path / "p2") == _files(tmp_path / "p1")
    report = json.loads((tmp_path / "p2" / "ram_merge_report.json").read_text())
    assert report["input_cache"]["kept_chunks"] > 0  # the main process's share
    assert report["input_cache"]["taken_chunks"] == report["input_cache"]["kept_chunks"]


def test_accelerate_launch_two_processes(inputs, tmp_path):
    root, base, agents = inputs
    config = _write_config(tmp_path, base, agents, "ram_plus", "cfg")
    ram_trl.merge(config, tmp_path / "p1", progress=False)
    result = launch_merge(2, config, tmp_path / "p2", launcher="accelerate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((tmp_path / "p2" / "ram_merge_report.json").read_text())["processes"] == 2
    assert _files(tmp_path / "p2") == _files(tmp_path / "p1")


def _second_rank_tensor(base_dir, agents):
    """A tensor that partition_by_bytes gives to rank 1 of 2 (the second heaviest)."""
    state = load_file(str(base_dir / "model.safetensors"))
    names = sorted(state)
    weights = [state[n].numel() * state[n].element_size() * (len(agents) + 1) for n in names]
    owned = partition_by_bytes(weights, 2)[1]
    return names[owned[0]]


@pytest.mark.parametrize("method", ["ram_plus", "task_arithmetic"])  # fails in the statistics / the write pass
def test_failure_on_one_rank_fails_every_rank_and_leaves_no_output(inputs, tmp_path, method):
    root, base, agents = inputs
    bad = tmp_path / "bad_agent"
    bad.mkdir()
    for item in agents[1].iterdir():
        (bad / item.name).write_bytes(item.read_bytes())
    state = load_file(str(bad / "model.safetensors"))
    name = _second_rank_tensor(base, agents)
    state[name] = state[name].clone()
    state[name].view(-1)[0] = float("nan")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    config = _write_config(tmp_path, base, [agents[0], bad, agents[2]], method, "bad")
    out = tmp_path / "out"
    result = launch_merge(2, config, out)
    assert result.returncode != 0
    assert "NaN" in result.stderr and name in result.stderr
    assert "another rank" in result.stderr  # rank 0 failed because rank 1 did
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.ram-trl-tmp")]


def test_partition_balances_bytes():
    owners = partition_by_bytes([10, 1, 7, 3, 3, 9], 2)
    loads = [sum([10, 1, 7, 3, 3, 9][i] for i in items) for items in owners]
    assert sorted(i for items in owners for i in items) == list(range(6))
    assert abs(loads[0] - loads[1]) <= 1
    assert partition_by_bytes([5, 5], 3) == [[0], [1], []]
    assert torch.equal(torch.tensor(partition_by_bytes([1, 2, 3], 1)[0]), torch.tensor([0, 1, 2]))
