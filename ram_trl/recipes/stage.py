"""One stage of a recipe, run as its own process: ``python -m ram_trl.recipes.stage --recipe R --stage S ...``.
Its manifest (``ram_stage.json``) is written last: its presence marks the stage as complete."""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ram_trl.errors import ConfigError
from ram_trl.evaluation.rewards import StageFailure, import_object, wrap_reward
from ram_trl.parallel import owned_process
from ram_trl.recipes.environment import trainer_settings
from ram_trl.recipes.schema import Recipe, StageSpec, load_recipe

__all__ = ["attach_telemetry", "build_trainer", "main", "preflight_rewards", "run_stage"]


def preflight_rewards(stage: StageSpec, rows: list[dict[str, Any]], count: int = 2) -> None:
    """Call each reward once on the first ``count`` rows (empty and reference completions), before training."""
    sample = rows[:count]
    if not sample or not stage.rewards:
        return
    completions = ["" if i % 2 == 0 else str(row.get("answer", "")) for i, row in enumerate(sample)]
    columns = {key: [row.get(key) for row in sample] for key in sample[0] if key != "prompt"}
    for path in stage.rewards:
        fn = wrap_reward(import_object(path, f"stage {stage.name!r}: reward function"), path, stage.name)
        try:
            fn(prompts=[row["prompt"] for row in sample], completions=completions, **columns)
        except StageFailure as exc:
            raise StageFailure(
                f"{exc} (checked before training on {len(sample)} of its rows, completions {completions!r})"
            ) from None


def _trainer_classes(trainer: str) -> tuple[type, type]:
    if trainer == "grpo":
        from trl import GRPOConfig, GRPOTrainer

        return GRPOConfig, GRPOTrainer
    from trl import RLOOConfig, RLOOTrainer

    return RLOOConfig, RLOOTrainer


def build_trainer(stage: StageSpec, base: Path, rows: list[dict[str, Any]], out: Path, seed: int) -> Any:
    """The stage's TRL trainer on ``base`` (loaded in float32) with its prompts, rewards and optional LoRA."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config_cls, trainer_cls = _trainer_classes(stage.trainer)
    args = config_cls(output_dir=str(out), **trainer_settings(stage, seed))
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    rewards = [
        wrap_reward(import_object(p, f"stage {stage.name!r}: reward function"), p, stage.name) for p in stage.rewards
    ]
    peft_config = None
    if stage.peft is not None:
        from peft import LoraConfig

        peft_config = LoraConfig(**stage.peft)
    return trainer_cls(
        model=model,
        reward_funcs=rewards,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def attach_telemetry(
    trainer: Any,
    base: Path,
    stage: StageSpec,
    prior: Sequence[Path],
    recipe: Recipe | None = None,
    val_files: dict[str, Path] | None = None,
) -> Any:
    """Bind the task-vector callback: it saves the agent and writes ``ram_stage.json`` at train end."""
    common = {
        "trainer": trainer,
        "base_model": str(base),
        "save_dtype": stage.save_dtype,
        "prior_stages": tuple(str(p) for p in prior),
        "stage_name": stage.name,
        "domain": stage.domain,
    }
    if stage.preview is None:
        from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback

        callback = TaskVectorSparsityCallback(**common)
    else:
        from ram_trl.callbacks.preview import MergePreviewCallback
        from ram_trl.evaluation.scoring import EvalTask
        from ram_trl.recipes.data import read_jsonl
        from ram_trl.stage.manifest import read_manifest

        if recipe is None:
            raise ConfigError(f"stage {stage.name!r}: the merge preview needs the recipe")
        files = val_files or {}
        names = [read_manifest(p).stage for p in prior] + [stage.name]
        tasks = []
        for name in names:
            file = files.get(name)
            rows = read_jsonl(file, f"stage {name!r}: validation prompts") if file and file.is_file() else []
            tasks.append(EvalTask(name, rows, recipe.stage(name).rewards, split="val"))
        callback = MergePreviewCallback(
            **common,
            tasks=tasks,
            evaluation=recipe.evaluation,
            method=stage.preview.method,
            parameters=stage.preview.parameters,
            seed=recipe.seed,
            merge_dtype=recipe.merge_dtype,
            preview_every=stage.preview.every,
            prompts=stage.preview.prompts,
            keep=stage.preview.keep,
        )
    trainer.add_callback(callback)
    callback.bind(trainer)
    return callback


def run_stage(
    recipe_path: Path,
    stage_name: str,
    base: Path,
    train_file: Path,
    out: Path,
    prior: Sequence[Path],
    val_files: dict[str, Path] | None = None,
) -> None:
    """Train one stage and leave the agent and its manifest in ``out`` (see the module docstring)."""
    from ram_trl.recipes.data import read_jsonl
    from ram_trl.recipes.progress import step_lines
    from ram_trl.stage.manifest import MANIFEST_NAME

    recipe, _ = load_recipe(recipe_path)
    if recipe.torch_threads is not None:
        torch.set_num_threads(recipe.torch_threads)
    stage = recipe.stage(stage_name)
    if not stage.trained:
        raise ConfigError(f"stage {stage.name!r} has an existing checkpoint; there is nothing to train")
    rows = read_jsonl(train_file, f"stage {stage.name!r}: training prompts")
    (out / MANIFEST_NAME).unlink(missing_ok=True)
    seed = int(stage.config.get("seed", recipe.seed))
    trainer = build_trainer(stage, base, rows, out, seed)
    attach_telemetry(trainer, base, stage, prior, recipe, val_files)
    trainer.add_callback(step_lines())  # the launcher's progress display reads these lines
    trainer.train()
    trainer.accelerator.wait_for_everyone()
    if trainer.is_world_process_zero():  # the log history (telemetry during training), for results.md
        from ram_trl.recipes.training import TRAINER_STATE

        trainer.state.save_to_json(str(out / TRAINER_STATE))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the stage process; exit code 0 on success, 1 with the reason on stderr otherwise."""
    parser = argparse.ArgumentParser(prog="python -m ram_trl.recipes.stage", description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", required=True, type=Path)
    parser.add_argument("--stage", required=True)
    parser.add_argument("--base", required=True, type=Path, help="the base checkpoint the stage starts from")
    parser.add_argument("--train-file", required=True, type=Path, help="training prompts (JSON Lines)")
    parser.add_argument("--out", required=True, type=Path, help="the stage directory (agent + ram_stage.json)")
    parser.add_argument("--prior", nargs="*", type=Path, default=[], help="earlier stages' manifests")
    parser.add_argument(
        "--val", nargs="*", default=[], metavar="STAGE=FILE", help="validation prompts of the merge preview"
    )
    args = parser.parse_args(argv)
    val_files = {}
    for item in args.val:
        name, sep, file = item.partition("=")
        if not sep:
            parser.error(f"--val {item!r}: write STAGE=FILE")
        val_files[name] = Path(file)
    from ram_trl.messages import owned_process_filters

    owned_process_filters()  # this process is ram_trl's: no third-party notice the user cannot act on
    try:
        with owned_process():  # the stage process is the library's: its compute pools may set thread counts
            run_stage(args.recipe, args.stage, args.base, args.train_file, args.out, args.prior, val_files)
    except Exception as exc:  # noqa: BLE001 - the runner reports it with the stage's log
        traceback.print_exc()
        cause = exc
        while cause.__cause__ is not None and not isinstance(cause, StageFailure | ConfigError):
            cause = cause.__cause__
        print(f"ram-trl stage {args.stage}: error: {cause}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    # under DeepSpeed on CPU the gloo groups outlive destroy_process_group: exit without the interpreter's
    # finalization then, which their threads can abort (ram_trl.distributed.exit_distributed, docs/ci.md)
    from ram_trl.distributed import exit_distributed

    exit_distributed(main())
