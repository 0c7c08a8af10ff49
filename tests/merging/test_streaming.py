"""ram_trl.merging.streaming: chunk order and contents, task vectors per chunk, compute blocks, non-finite inputs, the input
cache."""

from __future__ import annotations

import pytest
import torch

from ram_trl.errors import NonFiniteError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.io.safetensors_io import RowReader
from ram_trl.merging.planner import bytes_per_element
from ram_trl.merging.streaming import (
    COMPUTE_BLOCK_ELEMENTS,
    STATISTICS_BLOCK_ELEMENTS,
    InputCache,
    ReadCounter,
    chunk_nbytes,
    chunk_refs,
    compute_blocks,
    fill_delta,
    input_cache_budget,
    iter_chunks,
    statistics_blocks,
    to_deltas,
)
from tests.helpers import (
    BIAS,
    DOWN,
    EMBED,
    UP,
    base_tensors,
    make_checkpoints,
    open_ckpts,
    plan_for,
    save_checkpoint,
    with_position_ids,
)

CPU = torch.device("cpu")


def _setup(root, *, extra_agent=None, chunk_elements=24, shape_mismatch="error"):
    ckpts = make_checkpoints(root / "in")
    base, agents = open_ckpts(ckpts)
    if extra_agent is not None:
        agents.append(open_checkpoint(extra_agent, f"agent {len(agents)}"))
    plan = plan_for(
        base, agents, shape_mismatch=shape_mismatch, chunk_budget=bytes_per_element(len(agents)) * chunk_elements
    )
    return ckpts, base, agents, plan


def test_block_sizes():
    assert COMPUTE_BLOCK_ELEMENTS == 2**17 and STATISTICS_BLOCK_ELEMENTS == 2**18


def test_chunks_in_order_with_their_rows_and_bytes(tmp_path):
    ckpts, base, agents, plan = _setup(tmp_path)
    counter = ReadCounter()
    with RowReader() as reader:
        chunks = list(iter_chunks(base, agents, plan.tasks, reader, counter=counter))
    # 24-element chunks: embedding 6 chunks of 3 rows (the last 1), down 8 x 1 row, bias 1, up 8 x 3 rows
    assert [(c.task.name, c.start, c.stop) for c in chunks][:7] == [
        (EMBED, 0, 3),
        (EMBED, 3, 6),
        (EMBED, 6, 9),
        (EMBED, 9, 12),
        (EMBED, 12, 15),
        (EMBED, 15, 16),
        (DOWN, 0, 1),
    ]
    assert len(chunks) == 6 + 8 + 1 + 8
    assert counter.bytes == 3 * 2144  # base and two agents, each read once
    for chunk in chunks:
        name, rows = chunk.task.name, slice(chunk.start, chunk.stop)
        assert torch.equal(chunk.base, ckpts.base_tensors[name][rows])
        for values, tensors in zip(chunk.agents, ckpts.agent_tensors, strict=True):
            assert torch.equal(values, tensors[name][rows])
        assert chunk.lora == [None, None] and chunk.fishers is None and not chunk.extra_rows


def test_to_deltas_is_agent_minus_base_in_float32(tmp_path):
    ckpts, base, agents, plan = _setup(tmp_path)
    with RowReader() as reader:
        for chunk in iter_chunks(base, agents, plan.tasks, reader, read_ahead_depth=0):
            deltas, base_values = to_deltas(chunk, CPU, base, agents, reader)
            name, rows = chunk.task.name, slice(chunk.start, chunk.stop)
            assert torch.equal(base_values, ckpts.base_tensors[name][rows].reshape(-1))
            expected = torch.stack([t[name][rows].reshape(-1) - base_values for t in ckpts.agent_tensors])
            assert deltas.dtype == torch.float32 and torch.equal(deltas, expected)


def test_fill_delta_values_lora_and_missing_rows():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0])
    out = torch.full((4,), 9.0)
    fill_delta(out, torch.tensor([1.5, 2.0]), None, base)  # a shorter agent: zero past its rows
    assert out.tolist() == [0.5, 0.0, 0.0, 0.0]
    fill_delta(out, None, torch.tensor([0.25, -0.25, 0.5, 0.0]), base)  # a LoRA delta alone
    assert out.tolist() == [0.25, -0.25, 0.5, 0.0]
    fill_delta(out, torch.tensor([2.0, 2.0, 3.0, 5.0]), torch.tensor([0.5, 0.5, 0.5, 0.5]), base)  # both add up
    assert out.tolist() == [1.5, 0.5, 0.5, 1.5]
    fill_delta(out, None, None, base)  # an agent that does not touch the tensor
    assert out.tolist() == [0.0] * 4


def test_resized_agent_rows_and_extra_rows(tmp_path):
    bigger = base_tensors(seed=7, vocab=20)
    extra = save_checkpoint(tmp_path / "big", bigger, vocab_size=20)
    _, base, agents, plan = _setup(tmp_path, extra_agent=extra, shape_mismatch="merge_common_rows")
    embed = [t for t in plan.tasks if t.name == EMBED]
    assert [(a, b) for _, a, b in chunk_refs(embed, floating_only=False)][-3:] == [(15, 16), (16, 19), (19, 20)]
    with RowReader() as reader:
        merged_rows = [(c.start, c.stop) for c in iter_chunks(base, agents, embed, reader)]
        all_rows = [
            (c.start, c.stop, c.extra_rows) for c in iter_chunks(base, agents, embed, reader, floating_only=False)
        ]
    assert merged_rows[-1] == (15, 16)  # the merge passes stop at the base's rows
    assert all_rows[-2:] == [(16, 19, True), (19, 20, True)]
    with RowReader() as reader:
        last = list(iter_chunks(base, agents, embed, reader, floating_only=False))[-1]
    assert last.base is None and last.agents[:2] == [None, None]
    assert torch.equal(last.agents[2], bigger[EMBED][19:20])


def test_chunk_refs_skip_copied_tensors(tmp_path):
    plan = plan_for(*with_position_ids(tmp_path))
    floating = {t.name for t, _, _ in chunk_refs(plan.tasks, floating_only=True)}
    everything = {t.name for t, _, _ in chunk_refs(plan.tasks, floating_only=False)}
    assert everything - floating == {"model.position_ids"}
    assert floating == {EMBED, UP, BIAS, DOWN}


def test_compute_blocks_are_views_that_tile_the_chunk(tmp_path):
    _, base, agents, plan = _setup(tmp_path, chunk_elements=10_000)
    up = [t for t in plan.tasks if t.name == UP]
    with RowReader() as reader:
        (chunk,) = list(iter_chunks(base, agents, up, reader))
    blocks = compute_blocks(chunk, CPU, elements=40)  # 5 rows of 8 per block
    assert [(b.start, b.stop) for b in blocks] == [(0, 5), (5, 10), (10, 15), (15, 20), (20, 24)]
    assert torch.equal(torch.cat([b.base for b in blocks]), chunk.base)
    for t in range(2):
        assert torch.equal(torch.cat([b.agents[t] for b in blocks]), chunk.agents[t])
    assert blocks[1].base.data_ptr() == chunk.base[5:].data_ptr()  # views, not copies
    one_row = [(b.start, b.stop) for b in compute_blocks(chunk, CPU, elements=4)]  # at least one row per block
    assert one_row == [(r, r + 1) for r in range(24)]
    assert compute_blocks(chunk, CPU)[0] is chunk and statistics_blocks(chunk, CPU)[0] is chunk
    whole = compute_blocks(chunk, torch.device("meta"), elements=8)  # accelerators take the chunk whole
    assert len(whole) == 1 and whole[0] is chunk


@pytest.mark.parametrize("where", [0, 1])
def test_nonfinite_inputs_name_the_checkpoint_and_tensor(tmp_path, where):
    def poison(tensors):
        tensors = dict(tensors)
        tensors[UP] = tensors[UP].clone()
        tensors[UP][4, 2] = float("nan")
        return tensors

    ckpts = make_checkpoints(tmp_path / "in", overrides={where: poison})
    base, agents = open_ckpts(ckpts)
    plan = plan_for(base, agents)
    up = [t for t in plan.tasks if t.name == UP]
    with RowReader() as reader:
        (chunk,) = list(iter_chunks(base, agents, up, reader))
        with pytest.raises(
            NonFiniteError, match=rf"agent {where}: tensor '{UP}' holds 1 NaN/Inf values \(rows 0:24\)"
        ):
            to_deltas(chunk, CPU, base, agents, reader)
        deltas, _ = to_deltas(chunk, CPU, base, agents, reader, allow_nonfinite=True)
    assert int(torch.isnan(deltas).sum()) == 1


def test_input_cache_keeps_a_prefix_within_its_budget(tmp_path):
    """Chunks are kept in order until one does not fit; after that none is (a smaller later one neither), each kept
    chunk is taken once, and the figures count what happened."""
    _, base, agents, plan = _setup(tmp_path)
    with RowReader() as reader:
        chunks = list(iter_chunks(base, agents, plan.tasks, reader))
    sizes = [chunk_nbytes(c) for c in chunks]
    assert sizes[0] == 3 * 3 * 8 * 4  # embedding rows 0:3 (8 float32 per row) of the base and two agents
    cache = InputCache(budget=sizes[0] + sizes[1] + sizes[2] - 1)
    assert [cache.keep(c) for c in chunks[:4]] == [True, True, False, False]
    assert cache.kept_bytes == sizes[0] + sizes[1] and cache.kept_chunks == 2
    first = chunks[0]
    assert cache.take(first.task, first.start, first.stop) is first
    assert cache.take(first.task, first.start, first.stop) is None
    assert cache.take(chunks[2].task, chunks[2].start, chunks[2].stop) is None
    cache.clear()
    assert cache.take(chunks[1].task, chunks[1].start, chunks[1].stop) is None
    assert cache.summary() == {
        "budget": sizes[0] + sizes[1] + sizes[2] - 1,
        "kept_bytes": sizes[0] + sizes[1],
        "kept_chunks": 2,
        "taken_chunks": 1,
    }


def test_iter_chunks_takes_kept_chunks_instead_of_reading_them(tmp_path):
    _, base, agents, plan = _setup(tmp_path)
    with RowReader() as reader:
        first = list(iter_chunks(base, agents, plan.tasks, reader))
        cache = InputCache(budget=10**9)
        for chunk in first[:5]:
            cache.keep(chunk)
        counter = ReadCounter()
        again = list(iter_chunks(base, agents, plan.tasks, reader, counter=counter, cache=cache, readers=2))
    assert [a is b for a, b in zip(first, again, strict=True)] == [True] * 5 + [False] * (len(first) - 5)
    assert counter.bytes == 3 * 2144 - sum(chunk_nbytes(c) for c in first[:5])
    assert cache.taken_chunks == 5


def test_input_cache_budget():
    assert input_cache_budget(123, CPU) == 123
    assert input_cache_budget(0, torch.device("cuda")) == 0
    assert input_cache_budget(None, CPU) == 0  # auto: none on the CPU


def test_input_cache_budget_on_an_accelerator_is_half_its_free_memory(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10_000, 80_000))
    assert input_cache_budget(None, torch.device("cuda", 0)) == 5_000
