"""SCE: hand-computed selection, weights and erase on tiny vectors, and the engine streaming it in row chunks."""

from __future__ import annotations

import pytest
import torch

import ram_trl
from ram_trl.methods.base import ChunkInputs
from ram_trl.methods.sce import SceTensor, merge, sce_weights, select_mask
from tests.helpers import config_for, load_checkpoint, make_checkpoints


def test_selection_keeps_the_largest_variances_lowest_index_first_on_ties():
    taus = torch.tensor([[0.0, 1.0, 2.0, 0.0, 3.0, 3.0], [0.0, -1.0, 0.0, 0.0, 0.0, 0.0]])
    # variances across the two agents: 0, 1, 1, 0, 2.25, 2.25; four are nonzero
    assert select_mask(taus, 0.5).tolist() == [False, False, False, False, True, True]  # int(4 * 0.5) = 2
    # int(4 * 0.75) = 3: both 2.25, then the first of the two 1s
    assert select_mask(taus, 0.75).tolist() == [False, True, False, False, True, True]
    assert not select_mask(taus, 0.2).any()  # int(4 * 0.2) = 0
    assert not select_mask(taus, 0.0).any()


def test_weights_are_normalised_mean_squares():
    taus = torch.tensor([[1.0, 1.0], [2.0, 0.0]])  # mean squares 1 and 2
    assert sce_weights(taus).reshape(-1).tolist() == pytest.approx([1 / 3, 2 / 3])
    assert sce_weights(torch.zeros(4, 3)).reshape(-1).tolist() == [0.25] * 4  # below 1e-6: uniform


def test_erase_keeps_the_agents_of_the_elected_sign():
    taus = torch.tensor([[1.0, -2.0, 0.5, 0.0], [3.0, 1.0, -0.5, 0.0]])
    prepared = SceTensor(None, torch.tensor([[0.25], [0.75]]))
    out = merge(ChunkInputs("w", 0, taus.clone(), torch.zeros(4), {}, {}, prepared=prepared))
    # elem 0: both +, (0.25 + 2.25) / 1; elem 1: sum -1 elects -, only agent 0: -2;
    # elem 2: sum 0 elects +, only agent 0: 0.5; elem 3: nobody, 0 / 1e-6 = 0
    assert out.tolist() == [2.5, -2.0, 0.5, 0.0]


@pytest.mark.parametrize("select_topk", [1.0, 0.4])
def test_engine_streams_sce_in_row_chunks(tmp_path, select_topk):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=3, fraction=0.5)
    config = config_for(ckpts, "sce", parameters={"select_topk": select_topk})
    ram_trl.merge(config, tmp_path / "whole", progress=False)
    ram_trl.merge(config, tmp_path / "chunked", progress=False, chunk_budget=1024)
    whole, chunked = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "chunked")
    moved = 0
    for name, base in ckpts.base_tensors.items():
        assert torch.equal(whole[name], chunked[name]), name
        moved += int((whole[name] != base).sum())
    assert moved > 0
