"""ram_trl.merging.planner: the memory model, chunking, shard layout and input checks, with hand-computed values.

The inputs are the tiny float32 checkpoints of ``tests/helpers.py``: per model an embedding [16, 8], an MLP
matrix [24, 8] with its bias [24] and a matrix [8, 24]: 536 elements, 2144 bytes.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.merging.planner import PROCESS_BASELINE_BYTES, bytes_per_element, chunk_elements, plan_shards
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

MODEL_BYTES = 2144


def _plan(ckpts, **kwargs):
    return plan_for(*open_ckpts(ckpts), **{"needs_statistics": True, **kwargs})


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        # 10N + 20 + 2(N + 1) in + 3 out (+ N (8 + fisher))
        ((2,), 76),
        ((2, 4, 4, 4), 100),
        ((3, 2, 2), 72),
        ((1, 4, 2), 52),
        ((8, 2, 2, 4), 100 + 36 + 6 + 96),
    ],
)
def test_bytes_per_element(args, expected):
    assert bytes_per_element(*args) == expected


def test_chunk_elements_fits_the_budget_and_is_at_least_one():
    assert chunk_elements(1000, 2) == 13  # 13 * 76 = 988 <= 1000 < 14 * 76
    assert chunk_elements(76 * 24, 2) == 24
    assert chunk_elements(10, 2) == 1
    assert chunk_elements(256_000_000, 2, 4, 2) == 3_657_142  # 256 MB / 70 bytes


def test_plan_tasks_chunks_and_shards(tmp_path):
    # a budget of 24 elements: 3 rows of 8, 1 row of 24, 24 rows of 1
    plan = _plan(make_checkpoints(tmp_path), chunk_budget=76 * 24, max_shard_size=1000)
    assert [t.name for t in plan.tasks] == [EMBED, DOWN, BIAS, UP]  # storage order of the base
    assert [t.rows_per_chunk for t in plan.tasks] == [3, 1, 24, 3]
    assert [t.out_shape for t in plan.tasks] == [(16, 8), (8, 24), (24,), (24, 8)]
    assert [t.out_bytes for t in plan.tasks] == [512, 768, 96, 768]
    assert all(t.floating and t.agent_rows == (t.base_rows, t.base_rows) for t in plan.tasks)
    assert plan.tasks[0].chunks() == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 16)]
    assert plan.tasks[2].chunks() == [(0, 24)]
    assert [(s.file_name, [t.name for t in s.tasks], s.nbytes) for s in plan.shards] == [
        ("model-00001-of-00003.safetensors", [EMBED], 512),
        ("model-00002-of-00003.safetensors", [DOWN, BIAS], 864),
        ("model-00003-of-00003.safetensors", [UP], 768),
    ]
    assert plan.output_bytes == MODEL_BYTES
    assert plan.input_bytes == 3 * MODEL_BYTES
    assert plan.passes == 2 and plan.bytes_read == 6 * MODEL_BYTES
    assert plan.largest_chunk_bytes() == 24 * 76
    assert plan.peak_memory_estimate() == PROCESS_BASELINE_BYTES + 24 * 76
    assert plan.resized == []


def test_plan_with_the_defaults_bf16_output_and_ties(tmp_path):
    plan = _plan(make_checkpoints(tmp_path), out_dtype=torch.bfloat16, needs_statistics=False, trims_by_magnitude=True)
    assert plan.chunk_budget == 256_000_000
    assert [s.file_name for s in plan.shards] == ["model.safetensors"]
    assert [t.rows_per_chunk for t in plan.tasks] == [457_142, 152_380, 3_657_142, 457_142]
    assert all(t.out_dtype == torch.bfloat16 for t in plan.tasks)
    assert plan.output_bytes == MODEL_BYTES // 2
    # one pass, plus one extra read of base and agents per tensor for the TIES cut
    assert plan.passes == 1 and plan.bytes_read == 3 * MODEL_BYTES + 3 * MODEL_BYTES
    assert plan.largest_tensor_numel == 192
    assert plan.largest_chunk_bytes() == 192 * 70  # whole tensors fit: 70 bytes per element
    assert plan.peak_memory_estimate() == PROCESS_BASELINE_BYTES + 192 * 70 + 12 * 192


def test_plan_shards_gives_an_oversized_tensor_its_own_file(tmp_path):
    plan = _plan(make_checkpoints(tmp_path))
    shards = plan_shards(plan.tasks, max_shard_size=100)
    assert [[t.name for t in s.tasks] for s in shards] == [[EMBED], [DOWN], [BIAS], [UP]]
    assert shards[-1].file_name == "model-00004-of-00004.safetensors"
    assert [s.file_name for s in plan_shards(plan.tasks, MODEL_BYTES)] == ["model.safetensors"]


def test_resized_vocabulary_with_merge_common_rows(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in")
    bigger = base_tensors(seed=5, vocab=20)
    save_checkpoint(tmp_path / "big", bigger, vocab_size=20)
    base, agents = open_ckpts(ckpts)
    agents.append(open_checkpoint(tmp_path / "big", "agent 2"))
    plan = plan_for(base, agents, shape_mismatch="merge_common_rows", chunk_budget=bytes_per_element(3) * 24)
    embed = next(t for t in plan.tasks if t.name == EMBED)
    assert plan.resized == [EMBED]
    assert embed.out_rows == 20 and embed.agent_rows == (16, 16, 20) and embed.out_shape == (20, 8)
    # chunks split at the base's 16 rows: the extra rows are their own ranges
    assert embed.chunks() == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 15), (15, 16), (16, 19), (19, 20)]
    with pytest.raises(CheckpointError, match=r"shape \[20, 8\].*set shape_mismatch: merge_common_rows"):
        plan_for(base, agents)


def test_tokenizer_rows_keep_the_base_rows_and_leave_added_rows_out(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in")
    save_checkpoint(tmp_path / "big", base_tensors(seed=5, vocab=20), vocab_size=20)
    save_checkpoint(tmp_path / "small", base_tensors(seed=6, vocab=12), vocab_size=12)
    base, agents = open_ckpts(ckpts)
    plan = plan_for(base, [*agents, open_checkpoint(tmp_path / "big", "agent 2")], shape_mismatch="tokenizer_rows")
    embed = next(t for t in plan.tasks if t.name == EMBED)
    assert plan.resized == [] and embed.out_rows == 16 and embed.out_shape == (16, 8)
    assert embed.chunks()[-1][1] == 16  # no chunk reads past the base's rows
    # an agent with fewer rows than the base has no row for some of the tokenizer's tokens: refused
    with pytest.raises(CheckpointError, match=r"shape \[12, 8\]"):
        plan_for(base, [*agents, open_checkpoint(tmp_path / "small", "agent 2")], shape_mismatch="tokenizer_rows")


def test_input_mismatches_name_the_agent_tensor_and_file(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in")
    base, agents = open_ckpts(ckpts)
    extra = {**base_tensors(), "model.extra.weight": torch.zeros(2, 2)}
    save_checkpoint(tmp_path / "extra", extra)
    missing = {k: v for k, v in base_tensors().items() if k != UP}
    save_checkpoint(tmp_path / "missing", missing)
    integer = {**base_tensors(), DOWN: torch.zeros(8, 24, dtype=torch.int32)}
    save_checkpoint(tmp_path / "integer", integer)
    cases = {
        "extra": r"agent X: tensor 'model.extra.weight'.*not in the base model",
        "missing": rf"agent X: tensor '{UP}' of the base model is missing",
        "integer": rf"agent X: tensor '{DOWN}' has dtype torch.int32",
    }
    for name, message in cases.items():
        other = open_checkpoint(tmp_path / name, "agent X")
        with pytest.raises(CheckpointError, match=message):
            plan_for(base, [agents[0], other])


def test_non_floating_tensors_are_copied_not_merged(tmp_path):
    plan = plan_for(*with_position_ids(tmp_path), out_dtype=torch.bfloat16)
    ids = next(t for t in plan.tasks if t.name == "model.position_ids")
    assert not ids.floating and ids.out_dtype == torch.int64  # out_dtype applies to floating tensors only
    assert ids.out_bytes == 48


def test_storage_order_follows_the_files(tmp_path):
    # two shards written in the reverse of name order: the plan reads the first file first
    root = tmp_path / "sharded"
    tensors = base_tensors()
    save_checkpoint(root, {})  # config.json and an empty model.safetensors, replaced below
    (root / "model.safetensors").unlink()
    first, second = {UP: tensors[UP], DOWN: tensors[DOWN]}, {EMBED: tensors[EMBED], BIAS: tensors[BIAS]}
    save_file(first, str(root / "model-00001-of-00002.safetensors"))
    save_file(second, str(root / "model-00002-of-00002.safetensors"))
    weight_map = {n: "model-00001-of-00002.safetensors" for n in first}
    weight_map |= {n: "model-00002-of-00002.safetensors" for n in second}
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    base = open_checkpoint(root, "base model")
    plan = plan_for(base, [])
    # within a file, by offset (safetensors stores them by name): the first file, then the second
    assert [t.name for t in plan.tasks] == [DOWN, UP, EMBED, BIAS]
