"""The tracker on an accelerator: the trained model on the (fake) CUDA device, the base on disk or in memory.

Every measurement must equal the CPU one bit for bit; a host/device mix raises on the fake device as on CUDA (the
reported crash: a host float64 accumulator += a device 0-d sum in ``_measure``).
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.callbacks.telemetry import TaskVectorTracker
from tests.callbacks.telemetry.helpers import (
    random_model,
    random_training,
    tiny_model,
    train,
    write_base,
    write_full_prior,
    write_stage,
)

TIMING = ("_seconds", "_mb")


def _numbers(out: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in out.items() if not k.endswith(TIMING)}


@pytest.mark.parametrize("case", ["dense", "nonfinite"])
@pytest.mark.parametrize("source", ["disk", "reference", "snapshot"])
def test_device_model_measures_like_the_cpu_one(tmp_path, device, case, source):
    base = random_model()
    save_file({n: p.detach().clone() for n, p in base.named_parameters()}, str(tmp_path / "model.safetensors"))
    kwargs = {"chunk_elements": 64, "magnitude_sample": None}

    def tracker(model_base: torch.nn.Module | None) -> TaskVectorTracker:
        if source == "disk":
            return TaskVectorTracker(base_model=tmp_path, **kwargs)
        if source == "reference":
            return TaskVectorTracker(reference_model=model_base, **kwargs)
        return TaskVectorTracker(**kwargs)

    cpu_model = random_training(random_model(), case)
    expected = TaskVectorTracker(base_model=tmp_path, **kwargs).measure(cpu_model)
    model = random_model().to(device)
    reference = random_model().to(device) if source == "reference" else None
    measuring = tracker(reference)
    measuring.setup(model)  # the snapshot base is taken before training
    trained = random_training(random_model(), case)
    with torch.no_grad():
        for p, q in zip(model.parameters(), trained.parameters(), strict=True):
            p.copy_(q)
    assert next(model.parameters()).device == device
    out = measuring.measure(model)
    assert _numbers(out) == _numbers(expected)
    assert not math.isnan(out["task_vector/density"])


def test_device_model_with_prior_stages(tmp_path, device):
    base = write_base(tmp_path / "base")
    stages = [write_stage(tmp_path, "full", write_full_prior(tmp_path / "agent_full"), base)]
    expected = TaskVectorTracker(base_model=base, prior_stages=stages).measure(train(tiny_model()))
    model = train(tiny_model()).to(device)
    out = TaskVectorTracker(base_model=base, prior_stages=stages).measure(model)
    assert _numbers(out) == _numbers(expected)
    assert out["task_vector/prior/overlap"] == expected["task_vector/prior/overlap"] > 0


@pytest.mark.cuda
@pytest.mark.parametrize("source", ["disk", "snapshot"])
def test_real_cuda_model_measures_like_the_cpu_one(tmp_path, source):
    """The same check on a real GPU (skipped without one): the base resident on the GPU, the numbers the CPU's."""
    test_device_model_measures_like_the_cpu_one(tmp_path, torch.device("cuda"), "dense", source)
