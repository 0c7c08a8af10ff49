"""ram_trl/passes/merge.py: the merge-and-write pass's own pieces (output headers, rows past the base's, one chunk
merged); the pass as a whole is checked byte for byte in tests/test_engine_golden.py and against tests/reference.py
in tests/test_engine_reference.py."""

from __future__ import annotations

import pytest
import torch

from ram_trl.errors import NonFiniteError
from ram_trl.io.safetensors_io import RowReader
from ram_trl.passes.merge import extra_rows, planned_tensors, start_chunk
from ram_trl.passes.tensors import tensor_context
from ram_trl.streaming import iter_chunks
from tests.helpers import UP, make_checkpoints, open_ckpts, plan_for, run_context


def test_planned_tensors_are_the_shards_headers(tmp_path):
    base, agents = open_ckpts(make_checkpoints(tmp_path, num_agents=1))
    plan = plan_for(base, agents)
    for shard in plan.shards:
        planned = planned_tensors(shard)
        assert [(p.name, p.dtype, tuple(p.shape)) for p in planned] == [
            (t.name, t.out_dtype, tuple(t.out_shape)) for t in shard.tasks
        ]


def test_rows_past_the_base_are_the_mean_of_the_agents_that_have_them(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=1)
    run = run_context(ckpts, "task_arithmetic")
    with RowReader() as reader:
        chunk = next(iter_chunks(run.base, run.agents, run.tasks[:1], reader))
    first = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    second = torch.tensor([[3.0, 6.0]])  # holds the first of the two rows only
    chunk = type(chunk)(chunk.task, 0, 2, None, [first, second, None], [None, None, None], None)
    agents = [*run.agents, *run.agents, *run.agents]
    out = extra_rows(chunk, (2, 2), agents, allow_nonfinite=False)
    assert out.tolist() == [[2.0, 4.0], [3.0, 4.0]]
    bad = type(chunk)(chunk.task, 0, 1, None, [torch.tensor([[float("nan"), 0.0]])], [None], None)
    with pytest.raises(
        NonFiniteError, match=r"^agent 0 \(agent0, .*\): tensor .* holds NaN/Inf values in the rows it adds"
    ):
        extra_rows(bad, (1, 2), run.agents, allow_nonfinite=False)
    assert extra_rows(bad, (1, 2), run.agents, allow_nonfinite=True).isnan().any()


def test_a_chunk_merges_to_the_base_plus_the_weighted_task_vectors(tmp_path):
    ckpts = make_checkpoints(tmp_path, num_agents=2, fraction=0.5)
    run = run_context(ckpts, "task_arithmetic", agent_parameters={"weight": 0.5})
    task = next(t for t in run.tasks if t.name == UP)
    with RowReader() as run.reader:
        chunk = next(iter_chunks(run.base, run.agents, [task], run.reader))
        merged = start_chunk(run, chunk, tensor_context(run, task))()
    base = ckpts.base_tensors[UP]
    taus = [a[UP] - base for a in ckpts.agent_tensors]
    expected = (base + 0.5 * (taus[0] + taus[1]))[chunk.start : chunk.stop]
    assert merged.shape == expected.shape
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-6)
