"""Cost of the merge preview (MergePreviewCallback) relative to GRPO training steps, on the demo recipe's model.

Builds the demo's base (``recipes/demo-cpu.yaml``: Qwen2 4 x 128, bf16, character tokenizer; no warm start: the cost
does not depend on the rewards), trains the first ``--priors`` stages for ``--prior-steps`` steps each as the prior
stages, then trains the next stage (the demo's GRPO settings and ``torch_threads``) for ``--steps`` steps twice in
this process, interleaved: without the preview, and with it at the default settings (``ram_trl.defaults``: every
``ceil(max_steps / PREVIEW_COUNT)`` steps, ``PREVIEW_PROMPTS`` validation prompts per stage; ``--every`` and
``--prompts`` override them), RAM+ at the paper's settings, the demo's evaluation settings.

Reports the training step time (in the run with the preview: its train() wall less the previews and the reference
scores, over the steps; the load of a shared machine changes from minute to minute, so the ratio is taken within one
run, previews and steps interleaved; the run without the preview is shown beside it), one preview's time
(``merge_preview/seconds``: save + merge + two model loads + generation), the one-off reference scores at train
begin (the base on every merged stage, each prior agent on its own), the ratio preview / step, and the overhead of
the preview at the default interval on a demo stage of ``--demo-steps`` steps (150 in the recipe):
``(previews x preview + reference) / (demo_steps x step)``. Absolute seconds depend on the machine's load; the ratio
is measured in one process under the same load.

The stages train on ``--train-reward`` (default ``tests.helpers:distinct_chars``), not on the tasks' rewards: without
the demo's warm start the tasks' rewards are all zero, GRPO's advantages too, the weights never move, and every
preview after the first would reuse the first one's scores (equal weights are not scored again). The previews score
the tasks' rewards as in the demo; the cost does not depend on the rewards' values.

``--build`` replaces fields of the demo's base (e.g. the Qwen2-0.5B shape below, with the character tokenizer and
Qwen2-0.5B's 151,936 embedding rows), ``--batch`` / ``--generations`` the GRPO batch.

Usage::

    python benchmarks/bench_preview.py --workdir /tmp/bench_preview --steps 8 --priors 1
    python benchmarks/bench_preview.py --workdir /tmp/bench_preview_05b --steps 2 --prior-steps 1 --prompts 8 \
        --batch 8 --generations 4 --build '{"hidden_size": 896, "num_layers": 24, "intermediate_size": 4864,
        "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": true}'
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_preview"))
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--prior-steps", type=int, default=3)
    parser.add_argument("--priors", type=int, default=1, help="earlier stages merged (1 or 2 in the demo)")
    parser.add_argument("--every", type=int, default=None, help="default: ceil(steps / PREVIEW_COUNT)")
    parser.add_argument("--prompts", type=int, default=None, help="default: PREVIEW_PROMPTS; 0: all")
    parser.add_argument("--demo-steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--train-reward", default="tests.helpers:distinct_chars")
    parser.add_argument("--build", type=json.loads, default={}, help="JSON: fields of the base's build")
    parser.add_argument("--batch", type=int, default=None, help="per_device_train_batch_size (demo: 32)")
    parser.add_argument("--generations", type=int, default=None, help="num_generations (demo: 8)")
    args = parser.parse_args()

    os.environ.setdefault("ACCELERATE_USE_CPU", "1")
    sys.path.insert(0, str(REPO))  # the training reward's module
    from ram_trl import defaults
    from ram_trl.callbacks import TaskVectorSparsityCallback
    from ram_trl.callbacks.preview import MergePreviewCallback, default_preview_every
    from ram_trl.evaluation import EvalTask
    from ram_trl.recipes.data import draw_splits
    from ram_trl.recipes.schema import load_recipe
    from ram_trl.recipes.stage import build_trainer
    from ram_trl.synthetic import make_base_checkpoint

    recipe, root = load_recipe(REPO / "recipes" / "demo-cpu.yaml")
    torch.set_num_threads(recipe.torch_threads or 1)
    work = args.workdir
    build = {**(recipe.base.build or {}), **args.build}
    build["dtype"] = getattr(torch, build.get("dtype", "bfloat16"))
    base = work / "base"
    if not (base / "config.json").is_file():
        make_base_checkpoint(base, **build)
    specs = recipe.stages[: args.priors + 1]
    target = specs[-1]
    splits = {s.name: draw_splits(s, root) for s in specs}
    tasks = [EvalTask(s.name, splits[s.name][2], s.rewards, "val") for s in specs]
    prompts = defaults.PREVIEW_PROMPTS if args.prompts is None else (args.prompts or None)

    batch = {"per_device_train_batch_size": args.batch, "num_generations": args.generations}
    batch = {k: v for k, v in batch.items() if v is not None}

    def stage(spec, steps: int):
        config = {**spec.config, "max_steps": steps, **batch}
        return spec.model_copy(update={"config": config, "rewards": [args.train_reward]})

    priors = []
    for spec in specs[:-1]:
        out = work / spec.name
        if not (out / "ram_stage.json").is_file():
            trainer = build_trainer(stage(spec, args.prior_steps), base, splits[spec.name][0], out, recipe.seed)
            callback = TaskVectorSparsityCallback(
                trainer, base, stage_name=spec.name, save_dtype=spec.save_dtype, prior_stages=list(priors)
            )
            trainer.add_callback(callback)
            trainer.train()
        priors.append(out)

    rows = []
    for repeat in range(args.repeats):
        for with_preview in (False, True):
            out = work / f"{target.name}-{repeat}-{int(with_preview)}"
            trainer = build_trainer(stage(target, args.steps), base, splits[target.name][0], out, recipe.seed)
            if with_preview:
                callback = MergePreviewCallback(
                    trainer, base, prior_stages=priors, stage_name=target.name, tasks=tasks, evaluation=recipe.evaluation,
                    preview_every=args.every, prompts=prompts, save_dtype=target.save_dtype,
                )  # fmt: skip
            else:
                callback = TaskVectorSparsityCallback(
                    trainer, base, prior_stages=priors, stage_name=target.name, save_dtype=target.save_dtype
                )
            trainer.add_callback(callback)
            start = time.perf_counter()
            trainer.train()
            wall = time.perf_counter() - start
            rows.append({"preview": with_preview, "wall": wall, "callback": callback})
    without = statistics.median(r["wall"] for r in rows if not r["preview"])
    with_ = statistics.median(r["wall"] for r in rows if r["preview"])
    step_without = without / args.steps
    callbacks = [r["callback"] for r in rows if r["preview"]]
    history = [h for c in callbacks for h in c.history]
    seconds = statistics.median(h["seconds"] for h in history)
    merge = statistics.median(h["merge_seconds"] for h in history)
    reference = statistics.median(c.reference_seconds for c in callbacks)
    step = statistics.median(
        (r["wall"] - r["callback"].reference_seconds - sum(h["seconds"] for h in r["callback"].history)) / args.steps
        for r in rows
        if r["preview"]
    )
    distinct = len({(h["merged_sha256"], h["agent_sha256"]) for h in history})
    scored = {name: len(indices) for name, indices in callbacks[0].prompt_indices.items()}
    generated = sum(scored.values()) + scored[target.name]
    every = default_preview_every(args.demo_steps)
    count = math.ceil(args.demo_steps / every)
    overhead = (count * seconds + reference) / (args.demo_steps * step)
    print(
        f"- Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {os.cpu_count()} CPUs, "
        f"{platform.platform()}; torch {torch.__version__}; 1-minute load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"- Command: `python benchmarks/bench_preview.py {shlex.join(sys.argv[1:])}`; "
        f"stage `{target.name}` merged with {[p.name for p in priors]}; "
        f"{len(history)} previews ({distinct} of distinct weights); prompts scored per stage: {scored}"
    )
    print()
    parameters = sum(p.numel() for p in trainer.model.parameters())
    print(
        f"- Model: {parameters:,} parameters ({json.dumps(build, default=str)}); GRPO batch "
        f"{trainer.args.per_device_train_batch_size} completions ({trainer.args.num_generations} per prompt), "
        f"{trainer.args.max_completion_length} new tokens; evaluation {recipe.evaluation.max_new_tokens} new tokens, "
        f"batch {recipe.evaluation.batch_size}"
    )
    print()
    print(
        "| stage (priors) | s / training step (without the preview) | one preview, s (median) | of which merge, s | completions per preview "
        "| reference scores at train begin, s | preview / step | train() without / with, s "
        f"| overhead on a {args.demo_steps}-step demo stage (every={every}: {count} previews + reference) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    print(
        f"| {target.name} ({len(priors)}) | {step:.3f} ({step_without:.3f}) | {seconds:.2f} | {merge:.2f} | {generated} | {reference:.2f} "
        f"| {seconds / step:.2f} | {without:.1f} / {with_:.1f} | {overhead:.1%} |"
    )


if __name__ == "__main__":
    main()
