"""``ram-trl run``: base -> warm start -> stages -> analysis -> merges -> evaluation -> results (docs/recipes.md)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError, RamTrlError
from ram_trl.output import OutputDir, atomic_file
from ram_trl.recipes.data import read_jsonl
from ram_trl.recipes.environment import validate_recipe
from ram_trl.recipes.launch import StageError, StageLauncher
from ram_trl.recipes.layout import RunLayout, RunOptions, resolve_path, safe_name, stage_complete, stderr_console
from ram_trl.recipes.mechanism import MATCHED, matched_lambda
from ram_trl.recipes.prepare import RunPreparation
from ram_trl.recipes.progress import Progress
from ram_trl.recipes.schema import MergeRow, Recipe, StageSpec, apply_overrides, expand_merges, load_recipe
from ram_trl.recipes.training import read_training

__all__ = ["RunOptions", "StageError", "run_recipe", "run_seeds"]


class Run:
    """One execution of a recipe (use :func:`run_recipe`): its layout, preparation and launcher, then the rest."""

    def __init__(self, recipe: Recipe, root: Path, run_dir: Path, options: RunOptions) -> None:
        self.layout = RunLayout(recipe, root, run_dir, options)
        self.preparation = RunPreparation(self.layout)
        self.launcher = StageLauncher(self.layout)

    def analyze(self) -> dict[str, Any] | None:
        """The task-vector analysis of the agents (``RUN/analysis``), when the recipe enables it."""
        if not self.layout.recipe.analysis.enabled:
            return None
        from ram_trl.analysis import analyze

        spec = self.layout.recipe.analysis
        start = time.perf_counter()
        result = analyze(
            self.layout.base,
            [self.layout.agent_path(s) for s in self.layout.recipe.stages],
            self.layout.dir / "analysis",
            eps=spec.eps,
            r=spec.r,
            alpha=spec.alpha,
            names=self.layout.recipe.names,
            figures=self.layout.options.figures,
            progress=self.layout.options.progress,
        )
        self.layout.timed("analysis", start)
        return result

    def _model_entry(self, stage: StageSpec) -> dict[str, Any]:
        from ram_trl.stage.manifest import MANIFEST_NAME

        if stage.trained:
            return {"stage": str(self.layout.stage_dir(stage) / MANIFEST_NAME), "name": stage.name}
        return {"model": str(self.layout.agent_path(stage)), "name": stage.name}

    def fisher(self, rows: list[MergeRow]) -> None:
        """Each trained agent's diagonal Fisher on its training prompts, when a merge row uses the fisher method."""
        from ram_trl.methods import resolve_method

        fisher_rows = [r for r in rows if resolve_method(r.method)[0].needs_fisher]
        if not fisher_rows:
            return
        import torch

        from ram_trl.evaluation.fisher import estimate_fisher, load_agent, save_fisher

        settings = dict(fisher_rows[0].fisher)
        start = time.perf_counter()
        for stage in self.layout.recipe.stages:
            agent = self.layout.agent_path(stage)
            if not stage.trained:
                if not (agent / "fisher.safetensors").is_file():
                    raise ConfigError(
                        f"stage {stage.name!r}: the fisher merge needs {agent}/fisher.safetensors and ram_trl does not "
                        f"write into an existing agent's checkpoint; estimate it first: ram-trl fisher {agent} ..."
                    )
                continue
            prompts = [r["prompt"] for r in read_jsonl(self.layout.dir / "data" / stage.name / "train.jsonl")]
            wanted = dict(settings)
            if not wanted.get("sample") and wanted.get("num_samples", len(prompts)) > len(prompts):
                wanted["num_samples"] = len(prompts)
            model, tokenizer = load_agent(agent, self.layout.base, torch.float32)
            with self.layout.console.status(f"fisher {stage.name}"):
                fisher = estimate_fisher(model, tokenizer, prompts, **wanted)
            save_fisher(fisher, agent, {"stage": stage.name, "settings": repr(wanted)})
        self.layout.timed("fisher", start)

    def merges(self) -> list[tuple[MergeRow, Path]]:
        """Run every merge row of the recipe (sweeps expanded) into ``RUN/merges``."""
        from ram_trl.merging.engine import merge
        from ram_trl.merging.report import print_summary

        rows = expand_merges(self.layout.recipe)
        self.fisher(rows)
        done: dict[str, tuple[MergeRow, Path]] = {}
        start = time.perf_counter()
        (self.layout.dir / "logs").mkdir(exist_ok=True)
        log_path = self.layout.dir / "logs" / "merges.log"
        progress = Progress("merges", len(rows), bar=self.layout.options.progress, write=self.layout.say)
        deferred = [r for r in rows if r.parameters.get("lambda") == MATCHED]  # after RAM and a numeric TA row
        with open(log_path, "w", encoding="utf-8") as log:
            for row in [r for r in rows if r not in deferred] + deferred:
                if row in deferred:
                    row = _resolve_matched(row, list(done.values()), log)
                out = self.layout.dir / "merges" / safe_name(row.name)
                config = {
                    "merge_method": row.method,
                    "base_model": str(self.layout.base),
                    "models": [self._model_entry(s) for s in self.layout.recipe.stages],
                    "parameters": row.parameters,
                    "seed": self.layout.recipe.seed,
                    "name": row.name,
                    "out_dtype": row.out_dtype,
                }
                log.write(f"\n# merge {row.name}\n")
                try:
                    report = merge(config, out, overwrite=True, progress=False)
                    print_summary(report, file=log)
                except RamTrlError as exc:
                    raise RamTrlError(f"merge {row.name!r} failed: {exc} (log: {log_path})") from exc
                done[row.name] = (row, out)
                progress.update(len(done), row.name)
        progress.close()
        self.layout.timed("merges", start)
        self.layout.console.print(
            f"[green]merges[/]: {len(done)} in {self.layout.timings['merges']:.0f}s (log: {log.name})"
        )
        return [done[r.name] for r in rows]

    def evaluate(self, merged: list[tuple[MergeRow, Path]]) -> list[dict[str, Any]]:
        """Score the base, every agent and every merge on each stage's test and validation prompts."""
        import json

        from ram_trl.evaluation.scoring import evaluate_model

        if not self.layout.recipe.evaluation.enabled:
            return []
        tasks = self.layout.eval_tasks()
        models: list[tuple[str, str, Path, str | None, dict[str, Any]]] = [
            ("base", "base", self.layout.base, None, {})
        ]
        models += [(s.name, "agent", self.layout.agent_path(s), None, {}) for s in self.layout.recipe.stages]
        models += [(row.name, "merge", path, row.method, row.parameters) for row, path in merged]
        results = []
        start = time.perf_counter()
        (self.layout.dir / "eval").mkdir(exist_ok=True)
        from ram_trl.recipes.reuse import (
            EVALUATION_KEY,
            evaluation_key,
            model_digest,
            reusable_evaluation,
            reward_digests,
        )

        base_digest = model_digest(self.layout.base)
        settings = self.layout.recipe.evaluation.model_dump(mode="json")
        rewards, unsound = reward_digests(tasks)
        if unsound and self.layout.options.resume:
            self.layout.console.print(
                f"evaluation: scoring every model again, earlier scores cannot be matched: {unsound}"
            )
        reused = 0
        progress = Progress("evaluation", len(models), bar=self.layout.options.progress, write=self.layout.say)
        for name, kind, path, method, parameters in models:
            file = self.layout.dir / "eval" / f"{safe_name(name)}.json"
            digest = base_digest if Path(path) == Path(self.layout.base) else model_digest(path)
            key = None if rewards is None else evaluation_key(digest, base_digest, tasks, settings, rewards)
            scored = reusable_evaluation(file, key) if self.layout.options.resume else None
            was_reused = scored is not None
            if was_reused:
                reused += 1
            else:
                scored = evaluate_model(
                    path, tasks, self.layout.recipe.evaluation, base=self.layout.base, progress=False
                )
                if key is not None:
                    scored[EVALUATION_KEY] = key
                with atomic_file(file, "evaluation file") as tmp:
                    tmp.write_text(json.dumps(scored, indent=2) + "\n", encoding="utf-8")
            val = scored["splits"].get("val", {"scores": {}, "n": {}, "rewards": {}})
            effect = merge_effect(path) if kind == "merge" else None
            results.append(
                {
                    **({"effect": effect} if effect else {}),
                    "name": name,
                    "kind": kind,
                    "method": method,
                    "parameters": parameters,
                    "path": str(path),
                    "model_sha256": digest,
                    "scores": scored["scores"],
                    "n": scored["n"],
                    "rewards": scored["rewards"],
                    "val": {"scores": val["scores"], "n": val["n"], "rewards": val["rewards"]},
                }
            )
            progress.update(len(results), name + (" (reused)" if was_reused else ""))
        progress.close()
        self.layout.timed("evaluation", start)
        if reused:
            self.layout.console.print(
                f"evaluation: reused {reused} of {len(models)} earlier scores (same weights, prompts, rewards and "
                "settings; delete RUN/eval to score again)"
            )
        return results

    def results(self, rows: list[dict[str, Any]], analysis: dict[str, Any] | None) -> dict[str, Any]:
        """Write ``results.json``, ``results.md`` and the figures, and print the table."""
        from ram_trl.recipes.results import write_results
        from ram_trl.recipes.results_markdown import print_table
        from ram_trl.recipes.selection import regime_from_analysis

        evaluation = self.layout.recipe.evaluation
        decoding = (
            "greedy decoding" if not evaluation.do_sample else f"sampling at temperature {evaluation.temperature:g}"
        )
        results: dict[str, Any] = {
            "recipe": self.layout.recipe.name,
            "description": self.layout.recipe.description,
            "stages": [
                s.name
                for s in self.layout.recipe.stages
                if read_jsonl(self.layout.dir / "data" / s.name / "eval.jsonl")
            ],
            "specialists": {s.name: s.name for s in self.layout.recipe.stages},
            "decoding": f"{decoding}, max_new_tokens={evaluation.max_new_tokens}, seed {evaluation.seed}",
            "eps": self.layout.recipe.analysis.eps,
            "statistics": {
                "intervals": "bootstrap",
                "level": 0.95,
                "resamples": evaluation.bootstrap_resamples,
                "seed": evaluation.bootstrap_seed,
                "retention_min_gain": evaluation.retention_min_gain,
            },
            "sweeps": self.sweeps(),
            "rows": rows,
            "regime": regime_from_analysis(analysis) if analysis else {},
            "timings": self.layout.timings,
            "notes": self.layout.notes,
            "figures": [f"analysis/{f}" for f in (analysis or {}).get("figures", [])],
            "previews": self.previews(),
            "processes": self.stage_processes(),
            "training": read_training(
                {
                    s.name: self.layout.stage_dir(s)
                    for s in self.layout.recipe.stages
                    if s.trained and stage_complete(self.layout.stage_dir(s))
                }
            ),
        }
        warm = self.preparation.warm_start_record()
        if warm is not None:
            results["warm_start"] = warm
        write_results(results, self.layout.dir, figures=self.layout.options.figures)
        print_table(results)
        self.layout.console.print(f"results: {self.layout.dir / 'results.md'}")
        return results

    def stage_processes(self) -> dict[str, int]:
        """Per trained stage, how many processes trained it (as its manifest records), for results.md."""
        from ram_trl.stage.manifest import read_manifest

        out = {}
        for stage in self.layout.recipe.stages:
            if stage.trained and stage_complete(self.layout.stage_dir(stage)):
                count = read_manifest(self.layout.stage_dir(stage)).processes
                if count is not None:
                    out[stage.name] = count
        return out

    def previews(self) -> dict[str, dict[str, Any]]:
        """Per stage trained with ``preview:``, the preview record of its manifest."""
        from ram_trl.stage.manifest import read_manifest

        out = {}
        for stage in self.layout.recipe.stages:
            if stage.trained and stage.preview is not None and stage_complete(self.layout.stage_dir(stage)):
                record = read_manifest(self.layout.stage_dir(stage)).extra.get("preview")
                if record:
                    out[stage.name] = record
        return out

    def sweeps(self) -> list[dict[str, Any]]:
        """The merge entries that sweep a parameter: their label, swept parameters and row names."""
        out = []
        for spec in self.layout.recipe.merges:
            swept = [k for k, v in spec.parameters.items() if isinstance(v, list)]
            names = [r.name for r in expand_merges(self.layout.recipe.model_copy(update={"merges": [spec]}))]
            if swept and len(names) > 1:
                out.append({"label": spec.name or spec.method, "parameters": swept, "rows": names})
        return out


def run_recipe(recipe_path: str | os.PathLike | dict[str, Any], options: RunOptions | None = None) -> dict[str, Any]:
    """Run a recipe end to end (or validate it with ``options.dry_run``).

    Args:
        recipe_path (`str`, `os.PathLike` or `dict`): The recipe YAML (or its mapping).
        options (`RunOptions`, *optional*): Output directory, ``dry_run``, ``only``, overrides, ... (default:
            ``RunOptions()``).

    Returns:
        `dict[str, Any]`: The results (the content of ``results.json``); with ``dry_run``, the plan.

    Example::

        from ram_trl.recipes.runner import RunOptions, run_recipe

        results = run_recipe("recipes/demo-cpu.yaml", RunOptions(out=Path("runs/demo")))

    Raises:
        ConfigError: for an invalid recipe (before any work).
        StageError: when a stage process fails (finished stages are kept).
    """
    options = options or RunOptions()
    if options.seeds > 1 and not options.dry_run:
        return run_seeds(recipe_path, options)
    recipe, root = load_recipe(recipe_path, options.overrides)
    total = time.perf_counter()
    recipe_file = None if isinstance(recipe_path, dict) else Path(recipe_path).expanduser().resolve()
    where = f"recipe {recipe_path}" if recipe_file else "recipe"
    notes = validate_recipe(recipe, root, check_paths=options.check_paths, where=where)
    rows = expand_merges(recipe)
    console = stderr_console()
    if options.dry_run:
        plan = {
            "recipe": recipe.name,
            "stages": [
                {
                    "name": s.name,
                    "trainer": s.trainer if s.trained else None,
                    "kind": "lora" if s.peft else "full",
                    "checkpoint": s.checkpoint,
                    "accelerate_config": s.accelerate_config,
                }
                for s in recipe.stages
            ],
            "merges": [r.model_dump() for r in rows],
            "notes": notes,
        }
        console.print(
            f"[green]recipe {recipe.name!r} is valid[/]: {len(recipe.stages)} stages "
            f"({', '.join(recipe.names)}), {len(rows)} merges ({', '.join(r.name for r in rows)})"
        )
        for note in notes:
            console.print(f"  note: {note}")
        return plan
    out = options.out or (resolve_path(recipe.output_dir, root) if recipe.output_dir else Path("runs") / recipe.name)
    if recipe.torch_threads is not None:
        import torch

        torch.set_num_threads(recipe.torch_threads)
    run = Run(recipe, root, Path(out).resolve(), options)
    run.layout.notes.extend(notes)
    from ram_trl.evaluation.rewards import StageFailure

    try:
        run.preparation.prepare(recipe_file)
    except (ConfigError, StageFailure) as exc:  # the prompt rows and reward functions: name the recipe
        raise ConfigError(f"{where}: {exc}") from exc
    run.launcher.train_stages()
    if options.only is not None:
        console.print(f"stage {options.only} done; run without --only (with --resume) for the merges and evaluation")
        return {"recipe": recipe.name, "only": options.only}
    analysis = run.analyze()
    merged = run.merges()
    rows_scored = run.evaluate(merged)
    run.layout.timings["total"] = round(time.perf_counter() - total, 2)
    return run.results(rows_scored, analysis)


def run_seeds(recipe_path: str | os.PathLike | dict[str, Any], options: RunOptions) -> dict[str, Any]:
    """``ram-trl run --seeds N``: the pipeline per seed ``seed + k`` in ``OUT/seed_S/`` (prompts, base and warm
    start shared), then every score's mean and 95% t interval over the seeds in ``OUT/results.md``."""
    from dataclasses import replace

    from ram_trl.recipes.results import write_results
    from ram_trl.recipes.results_markdown import print_table
    from ram_trl.recipes.selection import aggregate_seeds

    if options.only is not None:
        raise ConfigError("--seeds runs the whole pipeline once per seed; it does not combine with --only")
    recipe, root = load_recipe(recipe_path, options.overrides)
    out = Path(
        options.out or (resolve_path(recipe.output_dir, root) if recipe.output_dir else Path("runs") / recipe.name)
    ).resolve()
    seeds = [recipe.seed + k for k in range(options.seeds)]
    runs = []
    for k, seed in enumerate(seeds):
        sub = out / f"seed_{seed}"
        if k:
            for name in ("base_init", "base"):
                first = out / f"seed_{seeds[0]}" / name
                if first.is_dir() and not (sub / name).exists():
                    with OutputDir(sub / name, what=f"seed {seed}'s copy of {name}") as tmp:
                        shutil.copytree(first, tmp, dirs_exist_ok=True)
        overrides = apply_overrides(
            options.overrides, {"seed": seed, "evaluation": {"seed": recipe.evaluation.seed + k}}
        )
        stderr_console().print(f"[bold]seed {seed}[/] ({k + 1} of {len(seeds)}): {sub}")
        runs.append(run_recipe(recipe_path, replace(options, out=sub, seeds=1, overrides=overrides)))
    results = aggregate_seeds(runs, seeds)
    fixed = [s.name for s in recipe.stages if s.trained and "seed" in s.config]
    if fixed:
        results["notes"].append(
            f"stages {', '.join(fixed)} set config.seed: their training is the same in every seed run"
        )
    write_results(results, out, figures=options.figures)
    print_table(results)
    stderr_console().print(f"results over {len(seeds)} seeds: {out / 'results.md'}")
    return results


def _resolve_matched(row: MergeRow, done: list[tuple[MergeRow, Path]], log: Any) -> MergeRow:
    """``row`` with ``lambda: matched`` replaced by the lambda at which task arithmetic has RAM's L2 norm."""
    found = matched_lambda([(r.method, r.parameters, (merge_effect(out) or {}).get("delta_norm")) for r, out in done])
    if found is None:
        raise RamTrlError(f"merge {row.name!r}: lambda: matched needs the nonzero delta norms of RAM and of TA")
    log.write(f"\n# {row.name}: lambda at RAM's L2 norm = {found[0]:.6g} (from row {done[found[1]][0].name})\n")
    return row.model_copy(update={"parameters": {**row.parameters, "lambda": found[0]}})


def merge_effect(path: Path) -> dict[str, Any] | None:
    """The ``effect`` section of a merged model's report (how much of the merge survives its dtype), if any."""
    import json

    from ram_trl.merging.report import REPORT_FILE

    report = Path(path) / REPORT_FILE
    return json.loads(report.read_text()).get("effect") if report.is_file() else None
