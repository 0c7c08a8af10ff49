"""MergePreviewCallback with the policy on an accelerator: a prior stage trained by a real TRL GRPO run, then a
Qwen2-shaped bf16 policy on the (fake) CUDA device previewed through the trainer events the way a GRPO trainer calls
them (the fake device cannot record autograd, so the steps' weights are set, not trained). Every logged metric, every
preview record (merged and agent digests, scores, retention) and every committed file equal the CPU run's: the save
from the device, the merge with the prior and the scoring on the host, the measurements on the device, the RNG kept
around the scoring (CUDA's too)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("trl")
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerControl, TrainerState  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from ram_trl.callbacks.preview import PREVIEW_PREFIX, MergePreviewCallback  # noqa: E402
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback  # noqa: E402
from ram_trl.evaluation.spec import EvaluationSpec  # noqa: E402
from ram_trl.synthetic import make_base_checkpoint  # noqa: E402
from tests.helpers import distinct_chars, preview_tasks, rl_config, rl_prompts, train_rl  # noqa: E402

pytestmark = [pytest.mark.slow]

STEPS = 4
EVALUATION = EvaluationSpec(max_new_tokens=8, batch_size=8)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base_checkpoint(  # tied embeddings, as Qwen2.5-0.5B: the save must keep the tie on the device too
        tmp_path_factory.mktemp("base") / "base", hidden_size=32, num_layers=2, intermediate_size=64,
        tie_word_embeddings=True,
    )  # fmt: skip


@pytest.fixture(scope="module")
def first(base, tmp_path_factory) -> Path:
    """The prior stage: a real GRPO run on the CPU with the telemetry callback."""
    out = tmp_path_factory.mktemp("stages") / "first"
    config = rl_config(GRPOConfig, out, max_steps=2, learning_rate=3e-3)
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="first")
    train_rl(GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(4))
    return out


def _step(policy: torch.nn.Module, step: int) -> None:
    """A sparse bf16 update of the policy (the same numbers on every device: drawn on the host, then copied)."""
    g = torch.Generator().manual_seed(step)
    with torch.no_grad():
        for p in policy.parameters():
            delta = torch.randn(p.shape, generator=g) * 5e-2 * (torch.rand(p.shape, generator=g) < 0.2)
            p.copy_((p.detach().cpu().float() + delta).to(p.dtype))


def _accelerator() -> SimpleNamespace:
    """One process, no DeepSpeed or FSDP: what the callback asks of ``trainer.accelerator``."""
    return SimpleNamespace(
        is_main_process=True,
        num_processes=1,
        is_fsdp2=False,
        state=SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None),
        wait_for_everyone=lambda: None,
        get_state_dict=lambda model: model.state_dict(),
        unwrap_model=lambda model: model,
    )


def _run(base: Path, first: Path, out: Path, device: torch.device) -> tuple[list[dict], list[dict], dict]:
    policy = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(device)
    assert next(policy.parameters()).device == device
    trainer = SimpleNamespace(
        model=policy,
        model_wrapped=None,
        ref_model=None,
        accelerator=_accelerator(),
        processing_class=AutoTokenizer.from_pretrained(base),
        args=SimpleNamespace(sync_ref_model=False),
        logged=[],
    )
    trainer.log = trainer.logged.append
    callback = MergePreviewCallback(
        trainer, base, prior_stages=[first], stage_name="second", tasks=preview_tasks(), evaluation=EVALUATION,
        preview_every=2, every_n_steps=2, save_dtype=torch.bfloat16,
    )  # fmt: skip
    args = SimpleNamespace(output_dir=str(out), logging_steps=2)
    state, control = TrainerState(global_step=0, max_steps=STEPS), TrainerControl()
    cuda_rng = None
    if device.type == "cuda":  # the training's CUDA RNG, which the scoring's seeding must leave as it was
        torch.cuda.manual_seed(1234)
        cuda_rng = torch.cuda.get_rng_state()
    callback.on_train_begin(args, state, control, model=policy)
    for step in range(1, STEPS + 1):
        _step(policy, step)
        state.global_step = step
        callback.on_step_end(args, state, control, model=policy)
    if cuda_rng is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    callback.on_train_end(args, state, control, model=policy)
    files = {f.name: f.read_bytes() for f in sorted(out.iterdir()) if f.is_file() and f.name != "ram_stage.json"}
    manifest = json.loads((out / "ram_stage.json").read_text())
    drop = ("seconds", "_mb")
    logged = [{k: v for k, v in e.items() if not k.endswith(drop)} for e in trainer.logged]
    history = [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in callback.history]
    preview = {k: v for k, v in manifest["extra"]["preview"].items() if k not in ("history", "reference_seconds")}
    telemetry = {k: v for k, v in manifest["telemetry"].items() if not k.endswith(drop)}
    telemetry.update({k: v for k, v in manifest.items() if k in ("steps", "base_model")})
    return logged, history, {"files": files, "preview": preview, "telemetry": telemetry}


def test_preview_on_a_device_policy_equals_the_cpu_run(base, first, tmp_path, fake_cuda):
    cpu = _run(base, first, tmp_path / "cpu" / "second", torch.device("cpu"))
    on_device = _run(base, first, tmp_path / "cuda" / "second", fake_cuda)
    logged, history, outputs = on_device
    assert logged == cpu[0]
    assert history == cpu[1]
    assert outputs["preview"] == cpu[2]["preview"]
    assert outputs["telemetry"] == cpu[2]["telemetry"]
    assert outputs["files"] == cpu[2]["files"]  # the kept agent, byte for byte
    # the run previewed what it should: two previews, the prior merged, the telemetry measured on the device
    assert [r["step"] for r in history] == [2, 4]
    assert all(r["merged_sha256"] != r["agent_sha256"] for r in history)
    previews = [e for e in logged if f"{PREVIEW_PREFIX}average" in e]
    assert len(previews) == 2 and all(f"{PREVIEW_PREFIX}score/first" in e for e in previews)
    densities = [e["task_vector/density"] for e in logged if "task_vector/density" in e]
    assert len(densities) == 2 and all(0.1 < d < 0.6 for d in densities)
