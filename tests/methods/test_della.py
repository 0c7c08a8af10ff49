"""DELLA: hand-computed ranks and keep probabilities, the L1 rescale, and the engine streaming della and
della_linear (the same output whole, in row chunks and on every run)."""

from __future__ import annotations

import pytest
import torch

import ram_trl
from ram_trl.errors import ConfigError
from ram_trl.methods import dare
from ram_trl.methods.della import keep_mask, rank_fraction
from tests.helpers import config_for, load_checkpoint, make_checkpoints


def test_rank_fraction_per_row_ties_lowest_index_first():
    magnitudes = torch.tensor([[0.3, 0.1, 0.2], [0.5, 0.5, 0.0]])
    assert rank_fraction(magnitudes).tolist() == [[1.0, 0.0, 0.5], [0.5, 1.0, 0.0]]
    assert rank_fraction(torch.tensor([[0.7], [0.2]])).tolist() == [[0.0], [0.0]]


def test_keep_probabilities_run_from_density_minus_to_plus_epsilon():
    # a million elements ranked 0..1 evenly: kept shares by quarter follow p = 0.3 + 0.4 * rank
    n = 1 << 20
    fraction = torch.arange(n, dtype=torch.float32) / (n - 1)
    kept = keep_mask(torch.ones(n), fraction, 0.5, 0.2, dare.dare_key(0, "w", 0), 0)
    shares = [float(q.mean()) for q in kept.reshape(4, -1)]
    assert shares == pytest.approx([0.35, 0.45, 0.55, 0.65], abs=0.005)
    # a chunk's mask is the same elements of the whole tensor's mask
    part = keep_mask(torch.ones(1000), fraction[5000:6000], 0.5, 0.2, dare.dare_key(0, "w", 0), 5000)
    assert torch.equal(part, kept[5000:6000])


@pytest.mark.parametrize("method", ["della", "della_linear"])
def test_engine_streams_della(tmp_path, method):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=2, fraction=0.6)
    config = config_for(ckpts, method, agent_parameters={"density": 0.5, "epsilon": 0.2}, seed=3)
    ram_trl.merge(config, tmp_path / "whole", progress=False)
    ram_trl.merge(config, tmp_path / "chunked", progress=False, chunk_budget=512)
    whole, chunked = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "chunked")
    for name in whole:
        assert torch.equal(whole[name], chunked[name]), name


@pytest.mark.filterwarnings("ignore:.*of its elements differ from the base:UserWarning")
def test_rescale_keeps_the_l1_norm(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=1, fraction=1.0)
    config = config_for(ckpts, "della_linear", agent_parameters={"density": 0.4, "epsilon": 0.1})
    ram_trl.merge(config, tmp_path / "out", progress=False)
    merged = load_checkpoint(tmp_path / "out")
    for name, base in ckpts.base_tensors.items():
        tau = ckpts.agent_tensors[0][name] - base
        kept = merged[name] - base
        moved = float((kept != 0).float().mean())
        assert 0.2 < moved < 0.6, (name, moved)  # about density of the elements survive
        torch.testing.assert_close(kept.abs().sum(), tau.abs().sum(), rtol=1e-4, atol=1e-6)  # scaled back up


def test_density_and_epsilon_must_leave_probabilities_in_0_1(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=1)
    config = config_for(ckpts, "della", agent_parameters={"density": 0.1, "epsilon": 0.15})
    with pytest.raises(ConfigError, match="density - epsilon"):
        ram_trl.merge(config, tmp_path / "out", progress=False)
