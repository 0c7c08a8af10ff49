"""TaskVectorSparsityCallback on an accelerator: a Qwen2-shaped policy on the (fake) CUDA device, its base on disk or
a reference model, driven through the trainer events the way a GRPO trainer calls them. The logged metrics equal the
CPU run's; the reported crash (a host accumulator += a device sum at the first measurement) cannot come back."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, TrainerControl, TrainerState  # noqa: E402

from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback  # noqa: E402
from ram_trl.synthetic import make_base_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base_checkpoint(
        tmp_path_factory.mktemp("base") / "base", hidden_size=32, num_layers=2, intermediate_size=64
    )


def _policy(base: Path, device: torch.device) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # a sparse bf16 update, as a few RL steps leave it
        for p in model.parameters():
            step = torch.randn(p.shape, generator=g) * 1e-2 * (torch.rand(p.shape, generator=g) < 0.1)
            p.add_(step.to(p.dtype))
    return model.to(device)


def _run(base: Path, tmp_path: Path, device: torch.device, source: str) -> dict[str, float]:
    policy = _policy(base, device)
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(device)
    trainer = SimpleNamespace(
        model=policy,
        ref_model=reference if source == "reference" else None,
        args=SimpleNamespace(sync_ref_model=False),
        logged=[],
    )
    trainer.log = trainer.logged.append
    callback = TaskVectorSparsityCallback(
        trainer, base_model=base if source == "disk" else None, every_n_steps=5, save_agent=False, write_stage=False
    )
    args = SimpleNamespace(output_dir=str(tmp_path / "out"), logging_steps=5)
    state, control = TrainerState(global_step=0, max_steps=10), TrainerControl()
    callback.on_train_begin(args, state, control, model=policy)
    state.global_step = 5
    callback.on_step_end(args, state, control, model=policy)
    (logs,) = trainer.logged  # one entry, at the measured step
    return {k: v for k, v in logs.items() if not k.endswith(("_seconds", "_mb"))}


@pytest.mark.parametrize("source", ["disk", "reference"])
def test_callback_logs_the_cpu_metrics_from_a_device_policy(base, tmp_path, fake_cuda, source):
    cpu = _run(base, tmp_path, torch.device("cpu"), source)
    on_device = _run(base, tmp_path, fake_cuda, source)
    assert on_device == cpu
    assert 0 < cpu["task_vector/density"] < 0.2
