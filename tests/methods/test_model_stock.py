"""Model Stock: hand-computed factors, and the engine streaming it (per tensor and filter_wise, in row chunks)."""

from __future__ import annotations

import math

import pytest
import torch

import ram_trl
from ram_trl.errors import ConfigError
from ram_trl.methods.model_stock import cosine, stock_factor
from tests.helpers import config_for, load_checkpoint, make_checkpoints


def _t(*taus: list[float]) -> float:
    vectors = [torch.tensor(tau) for tau in taus]
    norms = [torch.norm(v, dim=-1) for v in vectors]
    pairs = [
        cosine(vectors[i], vectors[j], norms[i], norms[j])
        for i in range(len(vectors))
        for j in range(i + 1, len(vectors))
    ]
    return float(stock_factor(len(vectors), pairs))


def test_factor_from_the_mean_cosine():
    assert _t([1.0, 0.0], [1.0, 0.0]) == 1.0  # aligned: t = 2 * 1 / (1 + 1), the average of the models
    assert _t([1.0, 0.0], [0.0, 1.0]) == 0.0  # orthogonal: t = 0, the base
    c = math.sqrt(0.5)  # 45 degrees: t = 2c / (1 + c)
    assert _t([1.0, 0.0], [1.0, 1.0]) == pytest.approx(2 * c / (1 + c))
    # three agents: the mean of the three pairwise cosines (1, 0, 0) = 1/3; t = 3 (1/3) / (1 + 2/3) = 0.6
    assert _t([1.0, 0.0], [2.0, 0.0], [0.0, 1.0]) == pytest.approx(0.6)


def test_opposite_task_vectors_keep_the_base():
    assert _t([1.0, 0.0], [-1.0, 0.0]) == 0.0  # 1 + (k - 1) cos = 0: no finite estimate, the base


@pytest.mark.parametrize("filter_wise", [False, True])
def test_engine_streams_model_stock(tmp_path, filter_wise):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=3, fraction=0.5)
    config = config_for(ckpts, "model_stock", parameters={"filter_wise": filter_wise})
    ram_trl.merge(config, tmp_path / "whole", progress=False)
    ram_trl.merge(config, tmp_path / "chunked", progress=False, chunk_budget=1024)
    whole, chunked = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "chunked")
    for name, base in ckpts.base_tensors.items():
        assert torch.equal(whole[name], chunked[name]), name
        models = [agent[name] for agent in ckpts.agent_tensors]
        shape = base.shape if filter_wise and base.dim() > 1 else (1, -1) if filter_wise else (-1,)
        taus = [(m - base).reshape(shape).double() for m in models]
        cos = [
            torch.nn.functional.cosine_similarity(taus[i], taus[j], dim=-1, eps=0)
            for i in range(3)
            for j in range(i + 1, 3)
        ]
        mean = torch.stack(cos).mean(dim=0).unsqueeze(-1)
        t = 3 * mean / (1 + 2 * mean)
        average = sum(m.reshape(shape).double() for m in models) / 3
        expected = (t * average + (1 - t) * base.reshape(shape).double()).reshape(base.shape)
        torch.testing.assert_close(whole[name].double(), expected, rtol=0, atol=1e-6, msg=name)


def test_model_stock_needs_two_models(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=1)
    with pytest.raises(ConfigError, match="model_stock merges at least 2 model"):
        ram_trl.merge(config_for(ckpts, "model_stock"), tmp_path / "out", progress=False)
