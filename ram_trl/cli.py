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

from ram_trl.cli_parser import build_parser
from ram_trl.errors import RamTrlError
from ram_trl.messages import one_voice
from ram_trl.runtime import gc_paused

#: The module each command's handler imports, imported up front with the garbage collector paused.
_COMMAND_MODULES = {
    "merge": "ram_trl.merging.engine",
    "example": "ram_trl.synthetic",
    "methods": "ram_trl.methods",
    "analyze": "ram_trl.analysis",
    "run": "ram_trl.recipes.runner",
    "eval": "ram_trl.evaluation.scoring",
    "demo": "ram_trl.recipes.runner",
    "fisher": "ram_trl.evaluation.fisher",
    "convert-gguf": "ram_trl.io.gguf",
}

#: Commands that load or save models with transformers (its progress bars are turned off when stderr is a log file).
_MODEL_COMMANDS = frozenset({"run", "eval", "demo", "fisher", "convert-gguf"})

EXAMPLE_MARKER = ".ram-trl-example"  #: Marks what ``ram-trl example`` wrote (what ``--overwrite`` may replace).

#: File-system errors reported as one ``error:`` line (exit 2) rather than a traceback.
_FILE_SYSTEM_ERRORS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENOENT, errno.EISDIR}


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
        config.write_text(config.read_text(encoding="utf-8").replace(str(temp.resolve()), str(root)), encoding="utf-8")
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

    from ram_trl.evaluation.scoring import EvalTask, evaluate_model
    from ram_trl.output import check_output_file
    from ram_trl.recipes.data import draw_splits
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
        + (
            "\n--quick is a smoke run: a few steps of everything, to check that each step runs; it cannot show "
            "learning (expect equal scores), run `ram-trl demo` for results"
            if args.quick
            else ""
        )
    )
    run_recipe(
        DEMO_RECIPE,
        RunOptions(out=Path(args.out), resume=args.resume, progress=not args.no_progress, overrides=overrides),
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
        args.source,
        args.output_dir,
        member=args.member,
        dtype=args.dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
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
    # the command line's process: each warning once, in our words; no third-party notice the user cannot act on
    with one_voice(logging.INFO if args.verbose else logging.WARNING):
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
        from ram_trl.parallel import owned_process

        try:
            with quiet, owned_process():  # this process is ours: the compute pools may set torch's thread counts
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
            print(f"ram-trl {args.command}: interrupted (signal {signum}); no output was left behind", file=sys.stderr)
            return 128 + int(signum)


if __name__ == "__main__":
    raise SystemExit(main())
