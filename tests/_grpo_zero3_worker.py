"""One rank of a real TRL GRPO run under DeepSpeed ZeRO-3 on 2 CPU processes, with TaskVectorSparsityCallback.

Run by tests/test_callbacks_zero3.py through the DeepSpeed launcher:
``python -m deepspeed.launcher.runner --num_gpus 2 _grpo_zero3_worker.py BASE OUT BETA`` (``BETA > 0``: GRPO holds a
reference model, which TRL partitions with ZeRO-3 too, and the telemetry uses it as the base). Every measurement runs with
every gathering collective patched to raise; the callback saves the agent (gathered by the trainer after training)
and the manifest to ``OUT``. Writes ``OUT/grpo_rank{R}.json``: the log history, the tracker's last metrics, whether
the parameters were ZeRO-3 partitions, and the collectives the measurements used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback  # noqa: E402
from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker  # noqa: E402
from ram_trl.distributed import exit_distributed  # noqa: E402
from tests.callbacks.telemetry._dist_worker import no_gathers  # noqa: E402
from tests.helpers import distinct_char_count, rl_prompts, train_rl, zero3_rl_config  # noqa: E402


def main() -> None:
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    base, out, beta = Path(args[0]), Path(args[1]), float(args[2])
    calls = {"all_reduce": 0, "all_reduce_bytes": 0, "measurements": 0, "partitioned": 0}
    measure = TaskVectorTracker.measure

    def guarded(self, model, step=None):
        calls["measurements"] += 1
        calls["partitioned"] += sum(hasattr(p, "ds_tensor") for p in model.parameters())
        with no_gathers(model, calls):
            return measure(self, model, step)

    TaskVectorTracker.measure = guarded
    config = zero3_rl_config(GRPOConfig, out, beta=beta)
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="grpo-zero3", save_dtype="bfloat16")
    trainer = train_rl(GRPOTrainer, base, config, callback, distinct_char_count, rl_prompts(4))
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "log_history": trainer.state.log_history,
        "last": callback.tracker.last,
        "base_source": callback.tracker.base_description,
        "calls": calls,
        "reference_partitioned": None
        if trainer.ref_model is None
        else all(hasattr(p, "ds_tensor") for p in trainer.ref_model.parameters()),
    }
    (out / f"grpo_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_distributed()  # barrier, groups destroyed; exits without finalizing while gloo threads live on (docs/ci.md)
