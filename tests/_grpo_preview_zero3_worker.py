"""One rank of a real TRL GRPO run under DeepSpeed ZeRO-3 on 2 CPU processes (gloo), with MergePreviewCallback.

Run by tests/callbacks/preview/test_partitions.py through the DeepSpeed launcher:
``python -m deepspeed.launcher.runner --num_gpus 2 _grpo_preview_zero3_worker.py BASE PRIOR OUT [MODE]``
(``MODE``: the method, default ``ram_plus``, or ``no-16bit-save`` for a DeepSpeed config that cannot save the policy;
what the preview refuses is refused at train begin and written to ``OUT/refused_rank{R}.txt``). The preview merges
the policy's ZeRO-3 partitions with the prior stage ``PRIOR`` every 2 steps. Each merge runs with every way of
gathering a parameter patched to raise (only the all-reduce of the statistics and a few small Python objects may
cross processes); each rank writes the merged elements it computed to ``OUT/ranges/rank{R}-step{S}.safetensors``
(keys ``NAME|OFFSET``) and ``OUT/preview_rank{R}.json``: the preview records, the step kept, the logged metrics and
the collectives the merges used.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import ram_trl.merging.range_merge  # noqa: E402
from ram_trl.callbacks.preview import MergePreviewCallback  # noqa: E402
from ram_trl.callbacks.telemetry.shards import iter_local_shards  # noqa: E402
from ram_trl.distributed import exit_distributed  # noqa: E402
from ram_trl.errors import ConfigError  # noqa: E402
from tests.callbacks.telemetry._dist_worker import no_gathers  # noqa: E402
from tests.helpers import distinct_chars, preview_tasks, rl_prompts, train_rl, zero3_rl_config  # noqa: E402

EVALUATION = {"max_new_tokens": 8, "batch_size": 8}


def main() -> None:
    args = [arg for arg in sys.argv[1:] if not arg.startswith("--local_rank")]
    base, prior, out = (Path(a) for a in args[:3])
    mode = args[3] if len(args) > 3 else "ram_plus"
    method = "ram_plus" if mode == "no-16bit-save" else mode
    calls = {"all_reduce": 0, "all_reduce_bytes": 0, "merges": 0, "partitioned": 0}
    merge_ranges = ram_trl.merging.range_merge.merge_ranges
    holder: dict = {}

    def guarded(resolved, current, ranges, ctx, **kwargs):
        calls["merges"] += 1
        model = holder["callback"].trainer.model
        calls["partitioned"] += sum(hasattr(p, "ds_tensor") for p in model.parameters())
        with no_gathers(model, calls, allow=("all_gather_object",)):
            result = merge_ranges(resolved, current, ranges, ctx, **kwargs)
        step = holder["callback"].trainer.state.global_step
        folder = out / "ranges"
        folder.mkdir(parents=True, exist_ok=True)
        tensors = {f"{r.name}|{r.offset}": v.contiguous() for r, v in zip(ranges, result.values, strict=True)}
        save_file(tensors, str(folder / f"rank{ctx.rank}-step{step}.safetensors"))
        return result

    ram_trl.merging.range_merge.merge_ranges = guarded
    preview = MergePreviewCallback.preview
    restored: list[bool] = []

    def checked_preview(self, state):
        """The preview, with the policy's partitions compared bit for bit before and after it."""
        before = [s.values.clone() for s in iter_local_shards(self.trainer.model)]
        metrics = preview(self, state)
        after = [s.values for s in iter_local_shards(self.trainer.model)]
        restored.append(all(torch.equal(a, b) for a, b in zip(before, after, strict=True)))
        return metrics

    MergePreviewCallback.preview = checked_preview
    config = zero3_rl_config(
        GRPOConfig, out, save_16bit=mode != "no-16bit-save", logging_steps=1, learning_rate=3e-3, seed=1
    )
    callback = MergePreviewCallback(
        base_model=base,
        prior_stages=[prior],
        stage_name="second",
        tasks=preview_tasks(),
        evaluation=EVALUATION,
        preview_every=2,
        method=method,
    )
    holder["callback"] = callback
    try:
        trainer = train_rl(GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(8))
    except ConfigError as error:  # a method a partition-local merge cannot run: refused at train begin
        (out / f"refused_rank{dist.get_rank()}.txt").write_text(str(error))
        return
    rank = dist.get_rank()
    result = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "partitioned": callback.partitioned,
        "history": [{k: v for k, v in h.items() if k != "seconds"} for h in callback.history],
        "kept_step": callback.kept_step,
        "logged": [e for e in trainer.state.log_history if "merge_preview/average" in e],
        "calls": calls,
        "restored": restored,
    }
    (out / f"preview_rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    exit_distributed()  # barrier, groups destroyed; exits without finalizing while gloo threads live on (docs/ci.md)
