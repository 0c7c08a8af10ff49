"""Local shards in one process: plain and wrapped modules, the base read on a flat range, reference slices."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import open_checkpoint
from ram_trl.io.safetensors_io import RowReader
from ram_trl.telemetry.shards import (
    LocalShard,
    ShardError,
    iter_counted_shards,
    iter_local_shards,
    matching_values,
    read_flat_range,
    training_context,
    unwrap_model,
)


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(3, 5)
        self.scale = torch.nn.Parameter(torch.tensor([2.0]))


class Wrapper(torch.nn.Module):
    """Stands for nothing: a plain container whose parameters carry a prefix (not unwrapped)."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.module = inner


def test_plain_module_yields_every_parameter_whole() -> None:
    model = Tiny()
    shards = list(iter_local_shards(model))
    assert [(s.name, s.shape, s.offset, s.numel, s.partitioned) for s in shards] == [
        ("scale", (1,), 0, 1, False),
        ("proj.weight", (5, 3), 0, 15, False),
        ("proj.bias", (5,), 0, 5, False),
    ]
    assert shards[1].values.data_ptr() == model.proj.weight.data_ptr()  # a view, no copy
    assert torch.equal(shards[1].values, model.proj.weight.detach().reshape(-1))


def test_compiled_module_is_unwrapped() -> None:
    model = Tiny()
    compiled = torch.compile(model)
    assert unwrap_model(compiled) is model
    assert [s.name for s in iter_local_shards(compiled)] == ["scale", "proj.weight", "proj.bias"]
    # an ordinary attribute called "module" is not a wrapper
    assert [s.name for s in iter_local_shards(Wrapper(model))][0] == "module.scale"


def test_single_process_counted_shards_are_the_local_shards() -> None:
    model = Tiny()
    assert [s.name for s in iter_counted_shards(model)] == [s.name for s in iter_local_shards(model)]
    assert not training_context().enabled


def _shard(
    name: str, values: list[float], shape: tuple[int, ...], offset: int, partitioned: bool
) -> LocalShard:
    return LocalShard(name, torch.tensor(values), shape, offset, partitioned)


def test_matching_values_slices_a_replicated_reference_and_passes_a_partition_through() -> None:
    trained = _shard("w", [9.0, 9.0], (2, 3), 3, True)
    full = _shard("w", [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], (2, 3), 0, False)
    assert matching_values(trained, full).tolist() == [3.0, 4.0]
    same = _shard("w", [3.0, 4.0], (2, 3), 3, True)
    assert matching_values(trained, same).tolist() == [3.0, 4.0]


def test_matching_values_rejects_other_ranges_and_shapes() -> None:
    trained = _shard("w", [9.0, 9.0], (2, 3), 3, True)
    with pytest.raises(ShardError, match=r"'w'.*elements \[0, 2\).*\[3, 5\)"):
        matching_values(trained, _shard("w", [0.0, 1.0], (2, 3), 0, True))
    with pytest.raises(ShardError, match=r"'w'.*shape \[3, 2\]"):
        matching_values(trained, _shard("w", [0.0] * 6, (3, 2), 0, False))


@pytest.fixture
def base_dir(tmp_path):
    weight = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    bias = torch.tensor([1.5, -2.0, 0.25], dtype=torch.bfloat16)
    save_file({"w": weight, "b": bias}, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_read_flat_range_reads_exactly_the_range(base_dir) -> None:
    checkpoint = open_checkpoint(base_dir, "base model")
    assert read_flat_range(checkpoint, "w", 5, 9).tolist() == list(range(5, 14))
    assert read_flat_range(checkpoint, "w", 23, 1).tolist() == [23.0]
    assert read_flat_range(checkpoint, "w", 24, 0).numel() == 0
    bias = read_flat_range(checkpoint, "b", 1, 2)
    assert bias.dtype == torch.bfloat16 and bias.tolist() == [-2.0, 0.25]
    with RowReader() as reader:
        assert read_flat_range(checkpoint, "w", 0, 3, reader=reader).tolist() == [0.0, 1.0, 2.0]


def test_read_flat_range_reads_only_the_requested_bytes(base_dir, monkeypatch) -> None:
    import os

    sizes: list[int] = []
    real = os.preadv

    def counting(fd, buffers, offset):
        sizes.append(sum(len(b) for b in buffers))
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", counting)
    read_flat_range(open_checkpoint(base_dir, "base model"), "w", 7, 5)
    assert sizes == [5 * 4]


def test_read_flat_range_names_the_tensor_and_range_on_bad_input(base_dir) -> None:
    checkpoint = open_checkpoint(base_dir, "base model")
    with pytest.raises(CheckpointError, match=r"base model .*has no tensor 'lm_head.weight'"):
        read_flat_range(checkpoint, "lm_head.weight", 0, 1)
    with pytest.raises(CheckpointError, match=r"tensor 'w' has 24 elements, cannot read \[20, 25\)"):
        read_flat_range(checkpoint, "w", 20, 5)
