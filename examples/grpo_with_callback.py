"""Add the task-vector sparsity callback to a GRPO run (TRL), on a tiny model built from a config (CPU, ~1 min).

    python examples/grpo_with_callback.py /tmp/grpo_callback

The callback logs the task vector's density, unique share and rho_t against earlier stages next to the rewards, and at
train end saves the agent in bf16 plus its stage manifest (``ram_stage.json``), which a merge config takes as
``models: [{stage: /tmp/grpo_callback/agent}]``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from ram_trl.callbacks import TaskVectorSparsityCallback
from ram_trl.recipes.tasks import tool_call_prompts
from ram_trl.synthetic import make_base_checkpoint


def digit_reward(completions: list[str], **kwargs) -> list[float]:
    """Share of digits in the completion: non-zero even for a random model, so GRPO has a signal from step 1."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def main(root: str) -> None:
    root_path = Path(root)
    base = make_base_checkpoint(root_path / "base", hidden_size=32, num_layers=1, intermediate_size=64)
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = GRPOConfig(
        output_dir=str(root_path / "agent"),  # the agent and ram_stage.json are written here
        max_steps=6,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        learning_rate=1e-4,
        logging_steps=1,
        bf16=False,
        report_to=[],
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[digit_reward],
        args=args,
        train_dataset=Dataset.from_list(tool_call_prompts(32)),
        processing_class=tokenizer,
    )
    callback = TaskVectorSparsityCallback(
        base_model=base, save_dtype="bfloat16", stage_name="tools", domain="tool use"
    )
    trainer.add_callback(callback)
    callback.bind(trainer)
    trainer.train()
    for entry in trainer.state.log_history:
        metrics = {k: v for k, v in entry.items() if k.startswith("task_vector/density") or k == "reward"}
        if metrics:
            print(entry.get("step"), metrics)
    print(json.dumps(json.loads((root_path / "agent" / "ram_stage.json").read_text())["telemetry"], indent=1)[:800])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "grpo_callback_out")
