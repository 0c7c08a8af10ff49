"""ram_trl/analysis/measure.py: which agents get a bfloat16 view, and the bf16 rounding of a chunk, by hand on real
checkpoints (the pass as a whole is checked in tests/test_analysis.py)."""

from __future__ import annotations

import torch

from ram_trl.analysis.measure import as_bf16, bf16_view_agents
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.merging.planner import build_plan
from ram_trl.merging.streaming import RawChunk
from tests.helpers import base_tensors, perturb, save_checkpoint


def _open(tmp_path, base_dtype, agent_dtypes):
    base = base_tensors()
    save_checkpoint(tmp_path / "base", {k: v.to(base_dtype) for k, v in base.items()})
    agents = []
    for t, dtype in enumerate(agent_dtypes):
        tensors = {k: v.to(dtype) for k, v in perturb(base, t).items()}
        agents.append(open_checkpoint(save_checkpoint(tmp_path / f"agent{t}", tensors), f"agent {t}"))
    base_ckpt = open_checkpoint(tmp_path / "base", "base model")
    plan = build_plan(
        base_ckpt, agents, out_dtype=None, shape_mismatch="error", needs_statistics=False, trims_by_magnitude=False
    )
    return base_ckpt, agents, plan.tasks


def test_only_agents_stored_wider_than_bf16_get_a_view(tmp_path):
    base, agents, tasks = _open(tmp_path, torch.bfloat16, [torch.bfloat16, torch.float32, torch.float16])
    assert bf16_view_agents(base, agents, tasks) == [False, True, False]


def test_a_wide_base_gives_every_agent_a_view(tmp_path):
    base, agents, tasks = _open(tmp_path, torch.float32, [torch.bfloat16, torch.bfloat16])
    assert bf16_view_agents(base, agents, tasks) == [True, True]


def test_as_bf16_rounds_to_nearest_even(tmp_path):
    _, _, tasks = _open(tmp_path, torch.float32, [torch.float32, torch.float32])
    u = 2.0**-7  # bf16's spacing just above 1.0
    base = torch.tensor([1.0 + u / 4, 1.0, 1.0])
    full = torch.tensor([1.0 + 0.75 * u, 1.0 + u / 2, 2.0])  # up; halfway: to even (1.0); exact
    lora = torch.tensor([u / 2, 1.5 * u, -0.5])  # added to the base in float32, then rounded
    chunk = RawChunk(tasks[0], 0, 1, base, [full, None], [None, lora])
    rounded = as_bf16(chunk)
    assert rounded.base.dtype == torch.bfloat16
    assert rounded.base.tolist() == [1.0, 1.0, 1.0]
    assert rounded.agents[0].tolist() == [1.0 + u, 1.0, 2.0]
    # 1 + u/4 + u/2 = 1 + 0.75u: up; 1 + 1.5u: halfway between 1 + u (odd) and 1 + 2u (even); 0.5
    assert rounded.agents[1].dtype == torch.bfloat16
    assert rounded.agents[1].tolist() == [1.0 + u, 1.0 + 2 * u, 0.5]
    assert rounded.lora == [None, None]
    assert chunk.base.dtype == torch.float32  # the input chunk is unchanged
