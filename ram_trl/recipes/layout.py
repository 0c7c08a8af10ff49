"""The run directory of ``ram-trl run`` (docs/recipes.md): its paths, its checks, the state the phases share."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError
from ram_trl.io.hub import parse_reference, resolve_model
from ram_trl.output import OutputDir
from ram_trl.recipes.data import read_jsonl
from ram_trl.recipes.schema import Recipe, StageSpec

__all__ = ["RunLayout", "RunOptions", "resolve_path", "safe_name", "stage_complete", "stderr_console"]


def stderr_console():
    """The console the run reports on (rich, on standard error)."""
    from rich.console import Console

    return Console(stderr=True)


def resolve_path(path: str, root: Path) -> Path:
    """A recipe's path, made absolute: relative paths are resolved against ``root`` (the recipe file's directory)."""
    p = Path(path).expanduser()
    return p if p.is_absolute() else (root / p).resolve()


def stage_complete(stage_dir: Path) -> bool:
    """Whether ``stage_dir`` holds a readable manifest whose checkpoint exists (a finished stage)."""
    from ram_trl.stage.manifest import MANIFEST_NAME, checkpoint_path, read_manifest

    try:
        manifest = read_manifest(stage_dir / MANIFEST_NAME)
    except ConfigError:
        return False
    checkpoint = checkpoint_path(manifest, stage_dir / MANIFEST_NAME)
    return (checkpoint / "config.json").is_file() or (checkpoint / "adapter_config.json").is_file()


def safe_name(name: str) -> str:
    """A directory name for a row label (``ram_plus(r=0.1)`` -> ``ram_plus_r=0.1_``)."""
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", name)


@dataclass
class RunOptions:
    """Options of :func:`run_recipe` (see ``ram-trl run --help``)."""

    out: Path | None = None
    only: str | None = None
    resume: bool = False
    dry_run: bool = False
    check_paths: bool = True
    progress: bool = True
    figures: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    seeds: int = 1


class RunLayout:
    """Where one run's files are, and the state its phases share (recipe, options, console, timings, notes)."""

    def __init__(self, recipe: Recipe, root: Path, run_dir: Path, options: RunOptions) -> None:
        self.recipe, self.root, self.dir, self.options = recipe, root, run_dir, options
        self.console = stderr_console()
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []

    def stage_dir(self, stage: StageSpec) -> Path:
        """Where a stage's trained agent and manifest go."""
        return self.dir / "stages" / stage.name

    def agent_path(self, stage: StageSpec) -> Path:
        """The stage's agent checkpoint: its given ``checkpoint`` (resolved), else the stage directory."""
        return resolve_path(stage.checkpoint, self.root) if stage.checkpoint else self.stage_dir(stage)

    @property
    def base(self) -> Path:
        """The base the stages and merges use: the warm-started base, else :attr:`initial_base`."""
        if self.recipe.warm_start is not None:
            return self.dir / "base"
        return self.initial_base

    @property
    def initial_base(self) -> Path:
        """The base before any warm start: ``RUN/base_init`` (built or converted), else ``base.path`` (resolved)."""
        if self.recipe.base.build is not None or self.recipe.base.gguf is not None:
            return self.dir / "base_init"
        path = resolve_path(self.recipe.base.path, self.root)
        if path.exists() or parse_reference(self.recipe.base.path) is None:
            return path
        return resolve_model(self.recipe.base.path, what="recipe base.path")  # a Hub id, through the cache

    def say(self, line: str) -> None:
        """Print a plain line on the run's console (no markup: names may hold brackets)."""
        self.console.print(line, markup=False, highlight=False)

    def timed(self, key: str, start: float) -> None:
        """Add the seconds since ``start`` (``time.perf_counter()``) to the timing ``key``."""
        self.timings[key] = round(self.timings.get(key, 0.0) + time.perf_counter() - start, 2)

    def resolved_recipe(self) -> dict[str, Any]:
        """The recipe with every path absolute (``RUN/recipe.yaml``, readable from anywhere)."""
        data = self.recipe.model_dump(mode="json", exclude_none=True)
        for key in ("path", "gguf"):
            if key in data["base"]:
                path = resolve_path(data["base"][key], self.root)
                hub_id = key == "path" and not path.exists() and parse_reference(data["base"][key]) is not None
                data["base"][key] = data["base"][key] if hub_id else str(path)  # a Hub id stays as written
        for stage in data["stages"]:
            for key in ("checkpoint", "accelerate_config"):
                if key in stage:
                    stage[key] = str(resolve_path(stage[key], self.root))
            for key in ("train_file", "eval_file", "val_file"):
                if key in stage.get("prompts", {}):
                    stage["prompts"][key] = str(resolve_path(stage["prompts"][key], self.root))
        return data

    def check_dir(self, recipe_file: Path | None) -> None:
        """Refuse a run directory that is or holds an input, or exists and is not a previous run."""
        data = self.resolved_recipe()
        reads: list[tuple[str, Path]] = [("recipe", recipe_file)] if recipe_file else []
        if "path" in data["base"]:
            reads.append(("base model", Path(data["base"]["path"])))
        if "gguf" in data["base"]:
            reads.append(("GGUF base", Path(data["base"]["gguf"])))
        for stage in data["stages"]:
            for key in ("checkpoint", "accelerate_config"):
                if key in stage:
                    reads.append((f"stage {stage['name']!r} {key}", Path(stage[key])))
            for key in ("train_file", "eval_file", "val_file"):
                if key in stage.get("prompts", {}):
                    reads.append((f"stage {stage['name']!r} prompts.{key}", Path(stage["prompts"][key])))
        markers = (
            "recipe.yaml",
            "results.json",
            "base_init/ram_build.json",
            "base_init/ram_gguf.json",
            "base/ram_warm_start.json",
        )
        OutputDir(self.dir, reads=reads, markers=markers, replace_previous=True, what="run directory").check()

    def eval_tasks(self) -> list[Any]:
        """Every stage's test and validation prompts with its rewards (stages without rows are left out)."""
        from ram_trl.evaluation.scoring import EvalTask

        tasks = []
        for split, file in (("test", "eval.jsonl"), ("val", "val.jsonl")):
            for stage in self.recipe.stages:
                path = self.dir / "data" / stage.name / file
                rows = read_jsonl(path) if path.is_file() else []
                if rows and stage.rewards:
                    tasks.append(EvalTask(stage.name, rows, stage.rewards, split=split))
        return tasks

    def check_tasks(self) -> list[Any]:
        """Every stage's warm-start check rows (``data/STAGE/check.jsonl``) with its rewards."""
        from ram_trl.evaluation.scoring import EvalTask

        tasks = []
        for stage in self.recipe.stages:
            path = self.dir / "data" / stage.name / "check.jsonl"
            rows = read_jsonl(path) if path.is_file() else []
            if rows and stage.rewards:
                tasks.append(EvalTask(stage.name, rows, stage.rewards, split="check"))
        return tasks
