"""Cost of one merge preview (MergePreviewCallback) relative to a GRPO training step, on the demo recipe's model.

Builds the demo's base (``recipes/demo-cpu.yaml``: Qwen2 4 x 128, bf16, character tokenizer; no warm start: the cost
does not depend on the rewards), trains its first stage (``coding``) for ``--prior-steps`` steps as the prior stage,
then trains the second stage (``tools``, the demo's GRPO settings and ``torch_threads``) for ``--steps`` steps twice,
interleaved: without the preview, and with it every ``--every`` steps (the merge with ``coding``, RAM+ at the
paper's settings, scored on both stages' 128 validation prompts with the demo's evaluation settings). Reports the
training step time (train() wall without the preview / steps), each preview's own time (``merge_preview/seconds``:
save + merge + two model loads + generation over 3 x 128 prompts) and their ratio at the default interval
(``ram_trl.defaults.PREVIEW_EVERY``).

Usage::

    python benchmarks/bench_preview.py --workdir /tmp/bench_preview --steps 20 --every 10
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_preview"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prior-steps", type=int, default=5)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()

    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    from ram_trl import defaults
    from ram_trl.callbacks import TaskVectorSparsityCallback
    from ram_trl.preview import MergePreviewCallback
    from ram_trl.recipes.data import draw_splits
    from ram_trl.recipes.evaluate import EvalTask
    from ram_trl.recipes.schema import load_recipe
    from ram_trl.recipes.stage import build_trainer
    from ram_trl.synthetic import make_base_checkpoint

    recipe, root = load_recipe(REPO / "recipes" / "demo-cpu.yaml")
    torch.set_num_threads(recipe.torch_threads or 1)
    work = args.workdir
    build = dict(recipe.base.build or {})
    build["dtype"] = getattr(torch, build.get("dtype", "bfloat16"))
    base = work / "base"
    if not (base / "config.json").is_file():
        make_base_checkpoint(base, **build)
    coding, tools = recipe.stage("coding"), recipe.stage("tools")
    splits = {s.name: draw_splits(s, root) for s in (coding, tools)}
    tasks = [EvalTask(name, split[2], recipe.stage(name).rewards, "val") for name, split in splits.items()]

    def stage(spec, steps: int):
        return spec.model_copy(update={"config": {**spec.config, "max_steps": steps}})

    prior = work / "coding"
    if not (prior / "ram_stage.json").is_file():
        trainer = build_trainer(
            stage(coding, args.prior_steps), base, splits["coding"][0], prior, recipe.seed
        )
        callback = TaskVectorSparsityCallback(
            trainer, base, stage_name="coding", save_dtype=coding.save_dtype
        )
        trainer.add_callback(callback)
        trainer.train()

    rows = []
    for repeat in range(args.repeats):
        for with_preview in (False, True):
            out = work / f"tools-{repeat}-{int(with_preview)}"
            trainer = build_trainer(stage(tools, args.steps), base, splits["tools"][0], out, recipe.seed)
            if with_preview:
                callback = MergePreviewCallback(
                    trainer, base, [prior], "tools", tasks=tasks, evaluation=recipe.evaluation,
                    preview_every=args.every, save_dtype=tools.save_dtype,
                )  # fmt: skip
            else:
                callback = TaskVectorSparsityCallback(
                    trainer, base, stage_name="tools", save_dtype=tools.save_dtype
                )
            trainer.add_callback(callback)
            start = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - start
            rows.append({"preview": with_preview, "wall": wall, "callback": callback})
    without = statistics.median(r["wall"] for r in rows if not r["preview"])
    with_ = statistics.median(r["wall"] for r in rows if r["preview"])
    step = without / args.steps
    history = [h for r in rows if r["preview"] for h in r["callback"].history]
    seconds = statistics.median(h["seconds"] for h in history)
    merge = statistics.median(h["merge_seconds"] for h in history)
    prompts = sum(len(t.rows) for t in tasks) + len(tasks[1].rows)
    print(
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {os.cpu_count()} CPUs, "
        f"{platform.platform()}; torch {torch.__version__}; 1-minute load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"- Command: `python benchmarks/bench_preview.py --steps {args.steps} --every {args.every} "
        f"--repeats {args.repeats}`; {len(history)} previews"
    )
    print()
    print(
        "| model | s / training step | one preview, s (median) | of which merge, s | prompts generated per preview "
        f"| preview / step | overhead at every={defaults.PREVIEW_EVERY} (default) | train() without / with, s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| demo (617,600 parameters) | {step:.3f} | {seconds:.2f} | {merge:.2f} | {prompts} | "
        f"{seconds / step:.1f} | {seconds / (defaults.PREVIEW_EVERY * step):.0%} | {without:.1f} / {with_:.1f} |"
    )


if __name__ == "__main__":
    main()
