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
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

from ram_trl.callbacks import TaskVectorSparsityCallback  # noqa: E402
from ram_trl.distributed import exit_distributed  # noqa: E402
from ram_trl.telemetry.tracker import TaskVectorTracker  # noqa: E402
from tests.helpers import distinct_char_count, rl_config, rl_prompts, train_rl  # noqa: E402
from tests.telemetry._dist_worker import no_gathers  # noqa: E402


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
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True},
        "zero_allow_untested_optimizer": True,
    }
    # Without a GPU, TrainingArguments' own set-up finds no backend for DeepSpeed and sees one process (the state
    # has num_processes 1 while the launcher started 2): set the state up with gloo first and let the trainer use it.
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend="gloo")
    assert state.distributed_type == DistributedType.DEEPSPEED and state.num_processes == 2
    config = rl_config(
        GRPOConfig,
        out,
        use_cpu=False,  # TrainingArguments' default: the DeepSpeed state set up above decides
        beta=beta,
        deepspeed=ds_config,
        accelerator_config={"use_configured_state": True},
    )
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="grpo-zero3")
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
