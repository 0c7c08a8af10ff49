"""A tiny PPO run (TRL 1.9.x ``trl.experimental.ppo.PPOTrainer``) with TaskVectorSparsityCallback.

Runs inside the TRL 1.9.2 virtualenv made by tests/test_callbacks_ppo.py (PPO was removed from newer TRL):
``python _ppo_job.py BASE OUT``. Policy, value and reward models are built from the base checkpoint (the value and
reward heads are new). Writes ``OUT/ppo_result.json``: the log history, the tracker's last metrics and where its
base came from; the callback saves the policy and ``ram_stage.json`` to ``OUT``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: E402
from trl.experimental.ppo import PPOConfig, PPOTrainer  # noqa: E402

from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback  # noqa: E402

STEPS = 3
BATCH = 4


def main() -> None:
    base, out = Path(sys.argv[1]), Path(sys.argv[2])
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(str(base), num_labels=1, dtype=torch.float32)
    prompts = ["ab", "cd", "ef", "gh"] * 4
    dataset = Dataset.from_dict({"input_ids": [tokenizer(p)["input_ids"] for p in prompts]})
    args = PPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=BATCH,
        local_rollout_forward_batch_size=BATCH,
        num_mini_batches=1,
        num_ppo_epochs=1,
        total_episodes=STEPS * BATCH,
        response_length=8,
        learning_rate=1e-3,
        logging_steps=2,
        num_sample_generations=0,
        report_to=["tensorboard"],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="ppo", domain="test", save_dtype="bfloat16")
    trainer = PPOTrainer(
        args=args,
        processing_class=tokenizer,
        model=policy,
        ref_model=None,
        reward_model=reward_model,
        train_dataset=dataset,
        value_model=value_model,
        callbacks=[callback],
    )
    callback.bind(trainer)
    trainer.train()
    result = {
        "log_history": trainer.state.log_history,
        "last": callback.tracker.last,
        "base_source": callback.tracker.base_description,
        "model_class": type(trainer.model).__name__,
        "max_steps": trainer.state.max_steps,
    }
    (out / "ppo_result.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
