"""One rank of a real TRL GRPO run under DDP on 2 CPU processes (gloo), with MergePreviewCallback.

Run by tests/callbacks/preview/test_callback_distributed.py through torchrun:
``torchrun --nproc_per_node 2 _grpo_preview_worker.py BASE PRIOR OUT``. The preview merges the policy with the prior
stage ``PRIOR`` every 2 steps; writes ``OUT/preview_rank{R}.json``: the distributed type, the preview records and the
step kept as this rank sees them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import PartialState  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from ram_trl.callbacks.preview import MergePreviewCallback  # noqa: E402
from ram_trl.distributed import exit_distributed  # noqa: E402
from tests.helpers import distinct_chars, preview_tasks, rl_config, rl_prompts, train_rl  # noqa: E402


def main() -> None:
    base, prior, out = (Path(a) for a in sys.argv[1:4])
    state = PartialState(cpu=True, backend="gloo")
    config = rl_config(
        GRPOConfig, out, logging_steps=1, learning_rate=3e-3, seed=1, accelerator_config={"use_configured_state": True}
    )
    callback = MergePreviewCallback(
        base_model=base,
        prior_stages=[prior],
        stage_name="second",
        tasks=preview_tasks(),
        evaluation={"max_new_tokens": 8, "batch_size": 8},
        preview_every=2,
    )
    trainer = train_rl(GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(8))
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "distributed_type": str(state.distributed_type),
        "history": [{k: v for k, v in h.items() if k != "seconds"} for h in callback.history],
        "kept_step": callback.kept_step,
        "logged": [e for e in trainer.state.log_history if "merge_preview/average" in e],
    }
    (out / f"preview_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_distributed()  # barrier, groups destroyed; exits without finalizing while gloo threads live on (docs/ci.md)
