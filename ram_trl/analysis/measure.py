"""The analysis pass: one streaming read of the floating tensors, measuring each tensor's task vectors."""

from __future__ import annotations

from dataclasses import replace

import torch

from ram_trl.io.checkpoint import Checkpoint
from ram_trl.io.safetensors_io import RowReader, dtype_itemsize
from ram_trl.merging.planner import TensorTask
from ram_trl.merging.streaming import RawChunk, ReadCounter, iter_chunks, to_deltas
from ram_trl.statistics import MagnitudeStatistics, TensorAnalysis
from ram_trl.statistics.counting import active_mask

BF16_ITEMSIZE = 2  #: Stored dtypes at most this wide (bytes per element) need no bfloat16 view: bf16 and fp16.


def bf16_view_agents(base: Checkpoint, agents: list[Checkpoint], tasks: list[TensorTask]) -> list[bool]:
    """Which agents get a bfloat16 view: those whose task vector is held wider than bf16."""
    base_wide = any(dtype_itemsize(t.base.dtype) > BF16_ITEMSIZE for t in tasks)
    return [
        base_wide
        or agent.kind == "lora"
        or any(dtype_itemsize(agent.tensors[t.name].dtype) > BF16_ITEMSIZE for t in tasks if t.name in agent.tensors)
        for agent in agents
    ]


def as_bf16(chunk: RawChunk) -> RawChunk:
    """The chunk as bfloat16 checkpoints would store it."""
    assert chunk.base is not None
    agents: list[torch.Tensor | None] = []
    for values, lora in zip(chunk.agents, chunk.lora, strict=True):
        if lora is not None:
            stored = chunk.base if values is None else values
            full = stored.reshape(-1)[: lora.numel()].to(torch.float32) + lora.reshape(-1)
            values = full
        agents.append(None if values is None else values.to(torch.bfloat16))
    return replace(chunk, base=chunk.base.to(torch.bfloat16), agents=agents, lora=[None] * len(agents))


def analysis_pass(
    base: Checkpoint,
    agents: list[Checkpoint],
    tasks: list[TensorTask],
    *,
    eps: float,
    bf16: bool,
    magnitudes: MagnitudeStatistics,
    read: ReadCounter,
    allow_nonfinite: bool = False,
    progress: bool = False,
) -> dict[str, TensorAnalysis]:
    """Stream the floating tensors ``tasks`` once and measure each of them."""
    from tqdm.auto import tqdm

    records: dict[str, TensorAnalysis] = {}
    device = torch.device("cpu")
    with RowReader() as reader, tqdm(total=len(tasks), desc="analyze", unit="tensor", disable=not progress) as bar:
        for chunk in iter_chunks(base, agents, tasks, reader, counter=read):
            name = chunk.task.name
            if name not in records:
                if records:
                    bar.update(1)
                records[name] = TensorAnalysis.zeros(len(agents), bf16)
            record = records[name]
            deltas, _ = to_deltas(chunk, device, base, agents, reader, allow_nonfinite)
            mask = active_mask(deltas, eps)
            record.eps.update(mask)
            record.exact.update(active_mask(deltas, 0.0))
            magnitudes.update(deltas, mask)
            del deltas, mask
            if record.bf16 is not None:
                rounded, _ = to_deltas(as_bf16(chunk), device, base, agents, reader, allow_nonfinite=True)
                record.bf16.update(active_mask(rounded, eps))
        if records:
            bar.update(1)
    return records


__all__ = ["analysis_pass", "as_bf16", "bf16_view_agents"]
