"""ram_trl/merging/passes/merge.py: the merge-and-write pass's own pieces (output headers, rows past the base's, one chunk
merged); the pass as a whole is checked byte for byte in tests/merging/test_engine_golden.py and against tests/reference.py
in tests/merging/test_engine_reference.py."""

from __future__ import annotations

import pytest
import torch

from ram_trl.errors import NonFiniteError
from ram_trl.io.safetensors_io import RowReader
from ram_trl.merging.passes.merge import extra_rows, planned_tensors, start_chunk
from ram_trl.merging.passes.tensors import tensor_context
from ram_trl.merging.streaming import iter_chunks
from tests.helpers import UP, config_for, make_checkpoints, open_ckpts, plan_for, run_context


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


@pytest.mark.parametrize("method", ["ram_plus", "ties", "dare_ties"])
def test_the_thread_plan_changes_no_output_byte(tmp_path, monkeypatch, method):
    """Both passes take their compute workers and readers from the thread plan of this process's cores; on 1, 2, 5 and
    64 simulated cores (1 to 60 compute workers, 1 to 4 readers) the merged files are the same bytes, the bytes read
    the same, and torch's thread setting is left alone."""
    import ram_trl
    from ram_trl import parallel
    from ram_trl.merging import streaming
    from ram_trl.merging.passes import merge as merge_pass
    from ram_trl.merging.passes import statistics as statistics_pass

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    # blocks of 64 elements and chunks of a few rows: many blocks and chunks in flight on the pool at once
    monkeypatch.setattr(streaming, "COMPUTE_BLOCK_ELEMENTS", 64)
    monkeypatch.setattr(streaming, "STATISTICS_BLOCK_ELEMENTS", 64)
    used: list[tuple[str, int | None, int]] = []
    for module in (merge_pass, statistics_pass):

        def spy_pool(device, workers=None, _module=module, _pool=module.compute_pool):
            used.append((_module.__name__, workers, -1))
            return _pool(device, workers)

        def spy_chunks(*args, _module=module, _chunks=module.iter_chunks, **kwargs):
            used.append((_module.__name__, None, kwargs["readers"]))
            return _chunks(*args, **kwargs)

        monkeypatch.setattr(module, "compute_pool", spy_pool)
        monkeypatch.setattr(module, "iter_chunks", spy_chunks)
    ckpts = make_checkpoints(tmp_path, num_agents=3, fraction=0.5)
    config = config_for(
        ckpts, method, agent_parameters=None if method == "ram_plus" else {"weight": 0.5, "density": 0.5}
    )
    before = torch.get_num_threads()
    outputs, reads = {}, {}
    for simulated in (1, 2, 5, 64):
        monkeypatch.setattr(parallel, "available_cores", lambda n=simulated: n)
        plan = parallel.plan_threads()
        used.clear()
        out = tmp_path / f"out{simulated}"
        report = ram_trl.merge(config, out, chunk_budget=4096, progress=False)
        assert torch.get_num_threads() == before
        passes = ["ram_trl.merging.passes.merge"] + (
            ["ram_trl.merging.passes.statistics"] if method == "ram_plus" else []
        )
        assert sorted(u for u in used if u[2] == -1) == sorted((p, plan.compute, -1) for p in passes)
        assert sorted(u for u in used if u[2] != -1) == sorted((p, None, plan.readers) for p in passes)
        outputs[simulated] = {f.name: f.read_bytes() for f in sorted(out.glob("*.safetensors"))}
        reads[simulated] = report["bytes_read"]
    assert [plan.readers for plan in map(parallel.plan_threads, (1, 2, 5, 64))] == [1, 1, 1, 4]
    assert all(outputs[n] == outputs[1] for n in outputs), method
    assert len(set(reads.values())) == 1
