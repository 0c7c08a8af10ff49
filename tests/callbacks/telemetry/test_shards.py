"""Local shards in one process: plain and wrapped modules (the multi-process cases: test_distributed_shards.py)."""

from __future__ import annotations

import torch

from ram_trl.callbacks.telemetry.shards import iter_local_shards, training_context, unwrap_model


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


def test_without_a_process_group_the_context_is_one_process() -> None:
    context = training_context()
    assert (context.rank, context.world_size, context.enabled, context.owns_group) == (0, 1, False, False)
