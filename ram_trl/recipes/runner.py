"""``ram-trl run``: base -> warm start -> one RL process per stage -> analysis -> merges -> evaluation -> results.

Run directory layout (``--out``, else the recipe's ``output_dir``, else ``runs/NAME``)::

    recipe.yaml              the validated recipe the stage processes read
    base_init/               the built base (recipes with base.build), or the converted GGUF base (base.gguf)
    base/                    the warm-started base (recipes with warm_start): base of every stage and merge
    data/STAGE/train.jsonl   the stage's training prompts; eval.jsonl its held-out test prompts, val.jsonl its
                             validation prompts (what sweeps and the merge to ship are chosen on)
    stages/STAGE/            the agent (saved in the stage's save_dtype) and ram_stage.json
    logs/STAGE.log           the stage process's output
    analysis/                ram-trl analyze over the agents (analysis.json, analysis.md, figures)
    merges/ROW/              one merged model per merge row
    eval/MODEL.json          each model's test and validation scores, per-prompt rewards, sample completions
    results.json, results.md, scores.png, retention.png

A stage is complete when its ``ram_stage.json`` exists and names an existing checkpoint; ``--resume`` skips
complete stages (the base, warm start and prompt files are reused whenever complete). A failed stage stops the
run with a :class:`StageError` naming the stage and its log; finished stages are kept.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ram_trl.errors import ConfigError, RamTrlError
from ram_trl.output import OutputDir, atomic_file
from ram_trl.recipes.data import draw_splits, draw_warm_rows, read_jsonl, split_check_rows, write_jsonl
from ram_trl.recipes.environment import validate_recipe
from ram_trl.recipes.schema import (
    MergeRow,
    Recipe,
    StageSpec,
    apply_overrides,
    expand_merges,
    load_recipe,
)

__all__ = [
    "STAGE_RECORD",
    "RunOptions",
    "StageError",
    "die_with_parent",
    "run_recipe",
    "run_seeds",
    "stage_complete",
]

#: What a stage was trained with, beside its manifest (``--resume`` compares it with the recipe).
STAGE_RECORD = "ram_recipe_stage.json"


class StageError(RamTrlError):
    """A stage process failed; the message names the stage, its exit code, its last error line and its log."""


@dataclass
class RunOptions:
    """Options of :func:`run_recipe` (see ``ram-trl run --help``).

    Args:
        out (`Path`, *optional*): The run directory (default: the recipe's ``output_dir``, else ``runs/NAME``).
        only (`str`, *optional*): Train only this stage (no merges, no evaluation).
        resume (`bool`, *optional*, defaults to `False`): Skip stages whose ``ram_stage.json`` is complete.
        dry_run (`bool`, *optional*, defaults to `False`): Validate the recipe and print the plan; run nothing.
        check_paths (`bool`, *optional*, defaults to `True`): With ``dry_run``, check that model checkpoints and
            prompt files exist.
        progress (`bool`, *optional*, defaults to `True`): Show progress bars.
        figures (`bool`, *optional*, defaults to `True`): Draw the results' charts.
        overrides (`dict[str, Any]`, *optional*, defaults to `{}`): Values merged into the recipe
            (:func:`~ram_trl.recipes.schema.apply_overrides`).
        seeds (`int`, *optional*, defaults to `1`): Run the pipeline this many times with consecutive seeds
            (:func:`run_seeds`).
    """

    out: Path | None = None
    only: str | None = None
    resume: bool = False
    dry_run: bool = False
    check_paths: bool = True
    progress: bool = True
    figures: bool = True
    overrides: dict[str, Any] = field(default_factory=dict)
    seeds: int = 1


def _console():
    from rich.console import Console

    return Console(stderr=True)


def _resolve(path: str, root: Path) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (root / p).resolve()


def stage_complete(stage_dir: Path) -> bool:
    """Whether ``stage_dir`` holds a readable manifest whose checkpoint exists (a finished stage).

    Args:
        stage_dir (`Path`): The stage's output directory.

    Returns:
        `bool`: ``True`` for a finished stage (the runner skips it).
    """
    from ram_trl.manifest import MANIFEST_NAME, checkpoint_path, read_manifest

    try:
        manifest = read_manifest(stage_dir / MANIFEST_NAME)
    except ConfigError:
        return False
    checkpoint = checkpoint_path(manifest, stage_dir / MANIFEST_NAME)
    return (checkpoint / "config.json").is_file() or (checkpoint / "adapter_config.json").is_file()


def safe_name(name: str) -> str:
    """A directory name for a row label (``ram_plus(r=0.1)`` -> ``ram_plus_r=0.1_``)."""
    return re.sub(r"[^A-Za-z0-9_.=-]", "_", name)


class Run:
    """One execution of a recipe (use :func:`run_recipe`).

    Args:
        recipe (`Recipe`): The validated recipe.
        root (`Path`): The directory the recipe's relative paths are resolved against (the recipe file's).
        run_dir (`Path`): The run directory everything is written into.
        options (`RunOptions`): The run's options (seed, resume, only one stage, ...).
    """

    def __init__(self, recipe: Recipe, root: Path, run_dir: Path, options: RunOptions) -> None:
        self.recipe, self.root, self.dir, self.options = recipe, root, run_dir, options
        self.console = _console()
        self.timings: dict[str, float] = {}
        self.notes: list[str] = []

    # -- paths -----------------------------------------------------------------------------------------------
    def stage_dir(self, stage: StageSpec) -> Path:
        """Where a stage's trained agent and manifest go.

        Args:
            stage (`StageSpec`): The stage.

        Returns:
            `Path`: ``RUN/stages/NAME``.
        """
        return self.dir / "stages" / stage.name

    def agent_path(self, stage: StageSpec) -> Path:
        """The stage's agent checkpoint: its given ``checkpoint`` (resolved), else the stage directory.

        Args:
            stage (`StageSpec`): The stage.

        Returns:
            `Path`: The agent's directory.
        """
        return _resolve(stage.checkpoint, self.root) if stage.checkpoint else self.stage_dir(stage)

    @property
    def base(self) -> Path:
        """The base model the stages train from and the merges use: the warm-started base, the built base, or
        the recipe's ``base.path`` (resolved)."""
        if self.recipe.warm_start is not None:
            return self.dir / "base"
        return self.initial_base

    @property
    def initial_base(self) -> Path:
        """The base before any warm start: ``RUN/base_init`` (built, or converted from GGUF), else the recipe's
        ``base.path`` (resolved)."""
        if self.recipe.base.build is not None or self.recipe.base.gguf is not None:
            return self.dir / "base_init"
        return _resolve(self.recipe.base.path, self.root)

    def _timed(self, key: str, start: float) -> None:
        self.timings[key] = round(self.timings.get(key, 0.0) + time.perf_counter() - start, 2)

    def resolved_recipe(self) -> dict[str, Any]:
        """The recipe with every path made absolute: the copy in the run directory, which the stage processes and
        ``ram-trl eval --recipe RUN/recipe.yaml`` read from anywhere.

        Returns:
            `dict[str, Any]`: The recipe as JSON-ready data.
        """
        data = self.recipe.model_dump(mode="json", exclude_none=True)
        for key in ("path", "gguf"):
            if key in data["base"]:
                data["base"][key] = str(_resolve(data["base"][key], self.root))
        for stage in data["stages"]:
            for key in ("checkpoint", "accelerate_config"):
                if key in stage:
                    stage[key] = str(_resolve(stage[key], self.root))
            for key in ("train_file", "eval_file", "val_file"):
                if key in stage.get("prompts", {}):
                    stage["prompts"][key] = str(_resolve(stage["prompts"][key], self.root))
        return data

    # -- phases ----------------------------------------------------------------------------------------------
    def draw(self) -> dict[str, tuple[list[dict[str, Any]], ...]]:
        """Every stage's prompt rows (training, test, validation, warm start), validated, and each reward function
        called once on them: the checks of user code that run before anything is written.

        Returns:
            `dict[str, tuple]`: Per stage, ``(train, test, val, warm, check)`` rows (``warm`` is ``None`` without a
            warm start, ``check`` without ``warm_start.accept``: the rows its criterion is measured on, held out of
            the warm-start rows, never a training prompt).

        Raises:
            ConfigError: with ``warm_start.accept`` when no stage has a check row (none draws warm-start rows).
        """
        from ram_trl.recipes.stage import preflight_rewards

        drawn = {}
        spec = self.recipe.warm_start
        for stage in self.recipe.stages:
            train, held, val = draw_splits(stage, self.root)
            preflight_rewards(stage, train or held or val)
            warm = draw_warm_rows(stage, held + val) if spec is not None else None
            check = None
            if warm is not None and spec.accept is not None and stage.rewards:
                warm, check = split_check_rows(warm, train, spec.accept.check_size)
            drawn[stage.name] = (train, held, val, warm, check)
        if spec is not None and spec.accept is not None and not any(d[4] for d in drawn.values()):
            raise ConfigError(
                "warm_start.accept measures its criterion on rows held out of the warm-start rows, and no stage draws "
                "any: give the stages prompts.warm_size (or remove warm_start.accept)"
            )
        return drawn

    def check_dir(self, recipe_file: Path | None) -> None:
        """Refuse a run directory that is or holds an input of the run (the recipe, the base, an agent, a prompt
        file, an accelerate config), or that exists and is not a previous run (it would be written into).

        Args:
            recipe_file (`Path`, *optional*): The recipe file read, if any.

        Raises:
            OutputError: naming the input or the foreign directory.
        """
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

    def prepare(self, recipe_file: Path | None = None) -> None:
        """Check the run directory, draw and check every stage's rows, write ``recipe.yaml`` and the prompt files,
        then build the base and run the warm start when the recipe asks for them.

        Args:
            recipe_file (`Path`, *optional*, defaults to `None`): The recipe file read (an input the run directory
                must not hold).
        """
        self.check_dir(recipe_file)
        start = time.perf_counter()
        drawn = self.draw()
        self.dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.resolved_recipe(), sort_keys=False)
        with atomic_file(self.dir / "recipe.yaml", "run recipe") as tmp:
            tmp.write_text(text, encoding="utf-8")
        for stage in self.recipe.stages:
            train, held, val, warm, check = drawn[stage.name]
            write_jsonl(train, self.dir / "data" / stage.name / "train.jsonl")
            write_jsonl(held, self.dir / "data" / stage.name / "eval.jsonl")
            write_jsonl(val, self.dir / "data" / stage.name / "val.jsonl")
            if warm is not None:
                write_jsonl(warm, self.dir / "data" / stage.name / "warm.jsonl")
            if check:
                write_jsonl(check, self.dir / "data" / stage.name / "check.jsonl")
            else:
                (self.dir / "data" / stage.name / "check.jsonl").unlink(missing_ok=True)
        self._timed("data", start)
        if self.recipe.base.build is not None:
            self.build_base()
        if self.recipe.base.gguf is not None:
            self.convert_base()
        if self.recipe.warm_start is not None:
            self.warm_start()

    def build_base(self) -> None:
        """Build the recipe's synthetic base (``base.build``) into ``RUN/base_init``, unless an identical build is
        already there."""
        from ram_trl.synthetic import make_base_checkpoint

        target = self.dir / "base_init"
        record = target / "ram_build.json"
        spec = yaml.safe_dump(self.recipe.base.build, sort_keys=True)
        if record.is_file() and record.read_text(encoding="utf-8") == spec:
            return
        start = time.perf_counter()
        import torch

        build = dict(self.recipe.base.build)
        if isinstance(build.get("dtype"), str):
            build["dtype"] = getattr(torch, build["dtype"])
        output = OutputDir(
            target, markers=("ram_build.json",), replace_previous=True, what="base model directory"
        )
        with output as tmp:
            make_base_checkpoint(tmp, **build)
            (tmp / "ram_build.json").write_text(spec, encoding="utf-8")
        self._timed("build_base", start)
        self.console.print(f"[green]built[/] base model {target}")

    def convert_base(self) -> None:
        """Convert the recipe's GGUF base (``base.gguf``) into ``RUN/base_init``
        (:func:`ram_trl.io.gguf.convert_gguf`), unless a conversion of the same bytes in the same dtype is there."""
        import json

        from ram_trl.io.gguf import RECORD_NAME, convert_gguf, open_gguf_source

        spec = self.recipe.base
        target = self.dir / "base_init"
        source = open_gguf_source(_resolve(spec.gguf, self.root), spec.gguf_member)
        record = target / RECORD_NAME
        if record.is_file():
            try:
                done = json.loads(record.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                done = None
            if (
                isinstance(done, dict)
                and done.get("sha256") == source.sha256()
                and done.get("dtype") == spec.gguf_dtype
            ):
                return
        start = time.perf_counter()
        self.console.print(f"converting the GGUF base {source.label} ...")
        result = convert_gguf(
            source.path, target, member=source.member, dtype=spec.gguf_dtype, replace_previous=True
        )
        self._timed("convert_base", start)
        self.console.print(
            f"[green]converted[/] {result['gguf_file']} -> {target} ({result['parameters']:,} parameters, "
            f"{result['dtype']}; logits identical to the GGUF model's in {result['dtype']})"
        )

    def warm_start(self) -> None:
        """Supervised warm start of the base (``warm_start``) into ``RUN/base``, unless an identical one is already
        there."""
        import json

        from ram_trl.recipes.warm_start import WARM_START_RECORD, acceptance_line, criterion, warm_start

        spec = self.recipe.warm_start
        source = self.initial_base
        if spec.abstain_share:
            spec = spec.model_copy(update={"abstain_reply": self.abstain_reply(spec.abstain_reply)})
        record = self.base / WARM_START_RECORD
        if record.is_file():
            try:
                done = json.loads(record.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, ValueError):
                done = None  # unreadable: warm-start again (the protocol replaces the directory)
            if (
                isinstance(done, dict)
                and done.get("spec") == spec.model_dump()
                and done.get("rows_digest") == self._rows_digest()
            ):
                return
        from ram_trl.recipes.tasks import mixture

        rows = mixture([read_jsonl(file) for file in self._warm_files()], seed=spec.seed)
        digest = self._rows_digest()
        start = time.perf_counter()
        steps = f"{spec.steps} + {spec.abstain_steps} abstaining" if spec.abstain_share else str(spec.steps)
        if spec.accept is not None:
            steps = f"until {criterion(spec)}: at least {spec.steps}"
        self.console.print(f"warm start: {steps} steps on {len(rows)} rows ...")
        result = warm_start(
            source,
            self.base,
            rows,
            spec,
            progress=self.options.progress,
            record_extra={"rows_digest": digest},
            checks=self.check_tasks() if spec.accept is not None else None,
            on_check=self._report_check,
        )
        self._timed("warm_start", start)
        self.console.print(
            f"[green]warm start[/] {result['steps']} steps: loss {result['loss_first']:.3f} -> "
            f"{result['loss_last']:.3f} ({result['seconds']:.0f}s)"
        )
        if "acceptance" in result:
            self.console.print(acceptance_line(result))

    def _report_check(self, phase: str, step: int, values: dict[str, float]) -> None:
        what = "sampled pass@k" if phase == "answers" else "greedy declines"
        shown = ", ".join(f"{stage} {value:.2f}" for stage, value in values.items())
        self.console.print(f"warm start ({phase}) step {step}: {what} {shown}")

    def abstain_reply(self, reply: str | None) -> str:
        """The warm start's abstaining reply: ``reply``, or when it is ``None`` the first of
        :data:`~ram_trl.recipes.schema.ABSTAIN_REPLIES` that earns no reward on any stage's validation or test rows.

        Raises:
            ConfigError: when ``reply`` earns a reward on some stage (it would no longer be an abstention: RL could
                keep it), naming the stage and the mean reward; or when every default reply does.

        Args:
            reply (`str`, *optional*): The recipe's reply; ``None`` chooses one.

        Returns:
            `str`: The reply.
        """
        from ram_trl.recipes.evaluate import score_completions
        from ram_trl.recipes.schema import ABSTAIN_REPLIES

        def earning(candidate: str) -> tuple[str, str, float] | None:
            for task in self.eval_tasks():
                earned = score_completions(task.functions(), task.rows, [candidate] * len(task.rows))
                if any(value > 0 for value in earned):
                    return task.stage, task.split, sum(earned) / len(earned)
            return None

        for candidate in ABSTAIN_REPLIES if reply is None else (reply,):
            found = earning(candidate)
            if found is None:
                return candidate
            if reply is not None:
                stage, split, mean = found
                raise ConfigError(
                    f"recipe {self.recipe.name!r}: warm_start.abstain_reply {reply!r} earns a reward on stage "
                    f"{stage!r} ({split} mean {mean:.3f}): choose a reply that no stage rewards (an abstention must "
                    "score 0)"
                )
        raise ConfigError(
            f"recipe {self.recipe.name!r}: every default warm_start.abstain_reply {list(ABSTAIN_REPLIES)} earns a "
            "reward on some stage: set warm_start.abstain_reply to a reply that no stage rewards"
        )

    def check_tasks(self) -> list[Any]:
        """Every stage's warm-start check rows (``data/STAGE/check.jsonl``) with its rewards.

        Returns:
            `list[EvalTask]`: The stages that have check rows, in order.
        """
        from ram_trl.recipes.evaluate import EvalTask

        tasks = []
        for stage in self.recipe.stages:
            path = self.dir / "data" / stage.name / "check.jsonl"
            rows = read_jsonl(path) if path.is_file() else []
            if rows and stage.rewards:
                tasks.append(EvalTask(stage.name, rows, stage.rewards, split="check"))
        return tasks

    def warm_start_record(self) -> dict[str, Any] | None:
        """The warm start's record (``RUN/base/ram_warm_start.json``) when it measured an acceptance criterion.

        Returns:
            `dict[str, Any]` or `None`: The record's ``acceptance`` with its ``steps``; ``None`` otherwise.
        """
        import json

        from ram_trl.recipes.warm_start import WARM_START_RECORD

        path = self.base / WARM_START_RECORD
        if self.recipe.warm_start is None or self.recipe.warm_start.accept is None or not path.is_file():
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
        if "acceptance" not in record:
            return None
        return {"steps": record["steps"], **record["acceptance"]}

    def _warm_files(self) -> list[Path]:
        """The warm start's rows: every stage's ``warm.jsonl``, or the trained stages' training rows when no stage
        draws warm-start rows."""
        warm = [self.dir / "data" / s.name / "warm.jsonl" for s in self.recipe.stages]
        if any(f.is_file() and f.stat().st_size for f in warm):
            return [f for f in warm if f.is_file()]
        return [self.dir / "data" / s.name / "train.jsonl" for s in self.recipe.stages if s.trained]

    def _rows_digest(self) -> str:
        import hashlib

        digest = hashlib.sha256()
        for file in self._warm_files():
            digest.update(file.read_bytes())
        for stage in self.recipe.stages:
            check = self.dir / "data" / stage.name / "check.jsonl"
            if check.is_file():
                digest.update(check.read_bytes())
        return digest.hexdigest()

    def train_stages(self) -> None:
        """Train every stage without a given checkpoint (only ``options.only`` when set; complete stages skipped
        with ``options.resume``).

        Raises:
            ConfigError: when the one stage asked for has a checkpoint already.
        """
        stages = [s for s in self.recipe.stages if s.trained]
        if self.options.only is not None:
            self.recipe.stage(self.options.only)
            stages = [s for s in stages if s.name == self.options.only]
            if not stages:
                raise ConfigError(
                    f"stage {self.options.only!r} has an existing checkpoint; there is nothing to train"
                )
        for stage in stages:
            if self.options.resume and stage_complete(self.stage_dir(stage)):
                self.check_recorded_stage(stage)
                self.console.print(f"[cyan]skip[/] stage {stage.name}: complete ({self.stage_dir(stage)})")
                continue
            self.train_stage(stage)

    def _prior(self, stage: StageSpec) -> list[Path]:
        from ram_trl.manifest import MANIFEST_NAME

        prior = []
        for other in self.recipe.stages:
            if other.name == stage.name:
                break
            if other.trained and stage_complete(self.stage_dir(other)):
                prior.append(self.stage_dir(other) / MANIFEST_NAME)
        return prior

    def stage_command(self, stage: StageSpec, work: Path | None = None) -> list[str]:
        """The stage process's command line; it writes into ``work`` (default: the stage directory).

        Args:
            stage (`StageSpec`): The stage.
            work (`Path`, *optional*, defaults to `None`): The directory the process writes into.

        Returns:
            `list[str]`: The command (``python -m ram_trl.recipes.stage ...``, or under ``accelerate launch``).
        """
        args = [
            "--recipe",
            str(self.dir / "recipe.yaml"),
            "--stage",
            stage.name,
            "--base",
            str(self.base),
            "--train-file",
            str(self.dir / "data" / stage.name / "train.jsonl"),
            "--out",
            str(work or self.stage_dir(stage)),
        ]
        prior = self._prior(stage)
        if prior:
            args += ["--prior", *map(str, prior)]
        if stage.preview is not None:
            merged = [p.parent.name for p in prior] + [stage.name]
            args += ["--val", *(f"{name}={self.dir / 'data' / name / 'val.jsonl'}" for name in merged)]
        if stage.accelerate_config is None:
            return [sys.executable, "-m", "ram_trl.recipes.stage", *args]
        config = _resolve(stage.accelerate_config, self.root)
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--config_file",
            str(config),
            "-m",
            "ram_trl.recipes.stage",
            *args,
        ]

    def stage_output(self, stage: StageSpec) -> OutputDir:
        """The output-commit protocol of a stage directory: the stage process writes into a temporary sibling,
        committed when it finished with a manifest; a previous run of the stage (one with ``ram_stage.json``, or
        the empty directory of an interrupted run) is replaced, anything else refused; it must not hold the base,
        another stage's agent or a prompt file.

        Args:
            stage (`StageSpec`): The stage.

        Returns:
            `OutputDir`: The stage directory's output protocol.
        """
        from ram_trl.manifest import MANIFEST_NAME

        reads = [("base model", self.base)] + [
            (f"stage {other.name!r} agent", self.agent_path(other))
            for other in self.recipe.stages
            if other.name != stage.name
        ]
        reads += [(f"stage {stage.name!r} prompt files", self.dir / "data" / stage.name)]
        return OutputDir(
            self.stage_dir(stage),
            markers=(MANIFEST_NAME,),
            replace_previous=True,
            reads=reads,
            what=f"stage {stage.name!r} directory",
        )

    def stage_record(self, stage: StageSpec) -> dict[str, Any]:
        """What a stage was trained with (kept in ``STAGE/ram_recipe_stage.json``): its spec and the run's seed.

        Args:
            stage (`StageSpec`): The stage.

        Returns:
            `dict[str, Any]`: The record (JSON).
        """
        return {"stage": stage.model_dump(mode="json"), "seed": self.recipe.seed}

    def check_recorded_stage(self, stage: StageSpec) -> None:
        """Refuse to ``--resume`` over a finished stage trained with another config than the recipe's.

        Args:
            stage (`StageSpec`): The stage about to be skipped.

        Raises:
            ConfigError: naming the stage, its directory and the first field that differs.
        """
        file = self.stage_dir(stage) / STAGE_RECORD
        if not file.is_file():
            return  # a stage finished before records were kept
        try:
            recorded = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            recorded = None
        wanted = json.loads(json.dumps(self.stage_record(stage)))
        if recorded != wanted:
            field = _first_difference(recorded, wanted)
            raise ConfigError(
                f"--resume: stage {stage.name!r} in {self.stage_dir(stage)} was trained with another config than the "
                f"recipe's ({field}); retrain it with --only {stage.name}, or restore the recipe"
            )

    def train_stage(self, stage: StageSpec) -> None:
        """Train one stage in its own process and commit its directory when it finished with a manifest.

        Args:
            stage (`StageSpec`): The stage.

        Raises:
            StageError: when the process fails or leaves no complete stage, naming the stage and its log.
        """
        out = self.stage_dir(stage)
        output = self.stage_output(stage)
        work = output.begin()  # removes a killed run's leftovers of this stage
        try:
            (work / STAGE_RECORD).write_text(
                json.dumps(self.stage_record(stage), indent=2, sort_keys=True) + "\n"
            )
            code, log, tail, started = self._run_stage_process(stage, work)
            complete = code == 0 and stage_complete(work)
            if complete:
                output.commit()
        except BaseException:
            output.abort()
            raise
        if not complete:
            output.abort()  # a failed stage leaves nothing behind; a previous result, if any, is kept as it was
        self._timed(f"stage:{stage.name}", started)
        if not complete:
            errors = [t for t in tail if "error" in t.lower()]
            reason = errors[-1] if errors else (tail[-1] if tail else "no output")
            done = [
                s.name
                for s in self.recipe.stages
                if s.trained and s.name != stage.name and stage_complete(self.stage_dir(s))
            ]
            raise StageError(
                f"stage {stage.name!r} failed (exit code {code}): {reason}\n  log: {log}\n  "
                + (f"finished stages kept: {', '.join(done)}; " if done else "")
                + (
                    f"the stage's previous result in {out} is kept as it was (--resume would reuse it); fix it "
                    f"and rerun with --only {stage.name} to retrain it"
                    if stage_complete(out)
                    else f"fix it and rerun with --resume to continue from stage {stage.name!r}"
                )
            )
        self.console.print(
            f"[green]stage[/] {stage.name}: done in {self.timings[f'stage:{stage.name}']:.0f}s -> {out}"
        )

    def _run_stage_process(self, stage: StageSpec, work: Path) -> tuple[int, Path, deque[str], float]:
        """Run the stage process writing into ``work``; returns its exit code, log, last lines and start time."""
        log = self.dir / "logs" / f"{stage.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = self.stage_command(stage, work)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        if self.recipe.torch_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.recipe.torch_threads)
        if not _has_cuda():
            env.setdefault("ACCELERATE_USE_CPU", "1")
        start = time.perf_counter()
        tail: deque[str] = deque(maxlen=40)
        with (
            open(log, "w", encoding="utf-8") as handle,
            self.console.status(f"stage {stage.name}: starting") as status,
        ):
            handle.write("$ " + " ".join(command) + "\n")
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=str(self.root),
                env=env,
                bufsize=1,
                preexec_fn=die_with_parent(os.getpid()),
            )
            try:
                assert process.stdout is not None
                for line in process.stdout:
                    handle.write(line)
                    text = line.strip()
                    if text:
                        tail.append(text)
                        status.update(
                            f"stage {stage.name} ({time.perf_counter() - start:.0f}s): {text[-100:]}"
                        )
                code = process.wait()
            except BaseException:  # interrupted: stop the stage process before its directory is removed
                _stop(process)
                raise
        return code, log, tail, start

    def analyze(self) -> dict[str, Any] | None:
        """The task-vector analysis of the agents (``RUN/analysis``), when the recipe enables it.

        Returns:
            `dict[str, Any]` or `None`: The analysis (:func:`ram_trl.analyze`), ``None`` when disabled.
        """
        if not self.recipe.analysis.enabled:
            return None
        from ram_trl.analysis import analyze

        spec = self.recipe.analysis
        start = time.perf_counter()
        result = analyze(
            self.base,
            [self.agent_path(s) for s in self.recipe.stages],
            self.dir / "analysis",
            eps=spec.eps,
            r=spec.r,
            alpha=spec.alpha,
            names=self.recipe.names,
            figures=self.options.figures,
            progress=self.options.progress,
        )
        self._timed("analysis", start)
        return result

    def _model_entry(self, stage: StageSpec) -> dict[str, Any]:
        from ram_trl.manifest import MANIFEST_NAME

        if stage.trained:
            return {"stage": str(self.stage_dir(stage) / MANIFEST_NAME), "name": stage.name}
        return {"model": str(self.agent_path(stage)), "name": stage.name}

    def fisher(self, rows: list[MergeRow]) -> None:
        """Estimate each agent's diagonal Fisher on its own stage's training prompts (``fisher.safetensors``
        beside the agent, what ``merge_method: fisher`` reads), when a merge row uses the fisher method.

        Args:
            rows (`list[MergeRow]`): The recipe's merge rows.

        Raises:
            ConfigError: when a given (untrained) agent has no ``fisher.safetensors``.
        """
        from ram_trl.methods import resolve_method

        fisher_rows = [r for r in rows if resolve_method(r.method)[0].needs_fisher]
        if not fisher_rows:
            return
        import torch

        from ram_trl.fisher_estimation import estimate_fisher, load_agent, save_fisher

        settings = dict(fisher_rows[0].fisher)
        start = time.perf_counter()
        for stage in self.recipe.stages:
            agent = self.agent_path(stage)
            if not stage.trained:
                if not (agent / "fisher.safetensors").is_file():
                    raise ConfigError(
                        f"stage {stage.name!r}: the fisher merge needs {agent}/fisher.safetensors and ram_trl does not "
                        f"write into an existing agent's checkpoint; estimate it first: ram-trl fisher {agent} ..."
                    )
                continue
            prompts = [r["prompt"] for r in read_jsonl(self.dir / "data" / stage.name / "train.jsonl")]
            wanted = dict(settings)
            if not wanted.get("sample") and wanted.get("num_samples", len(prompts)) > len(prompts):
                wanted["num_samples"] = len(prompts)
            model, tokenizer = load_agent(agent, self.base, torch.float32)
            with self.console.status(f"fisher {stage.name}"):
                fisher = estimate_fisher(model, tokenizer, prompts, **wanted)
            save_fisher(fisher, agent, {"stage": stage.name, "settings": repr(wanted)})
        self._timed("fisher", start)

    def merges(self) -> list[tuple[MergeRow, Path]]:
        """Run every merge row of the recipe (sweeps expanded) into ``RUN/merges``.

        Returns:
            `list[tuple[MergeRow, Path]]`: Each row and its merged model.
        """
        from tqdm.auto import tqdm

        from ram_trl.engine import merge

        rows = expand_merges(self.recipe)
        self.fisher(rows)
        done = []
        start = time.perf_counter()
        (self.dir / "logs").mkdir(exist_ok=True)
        log_path = self.dir / "logs" / "merges.log"
        with open(log_path, "w", encoding="utf-8") as log:
            for row in tqdm(rows, desc="merges", disable=not self.options.progress):
                out = self.dir / "merges" / safe_name(row.name)
                config = {
                    "merge_method": row.method,
                    "base_model": str(self.base),
                    "models": [self._model_entry(s) for s in self.recipe.stages],
                    "parameters": row.parameters,
                    "seed": self.recipe.seed,
                    "name": row.name,
                }
                log.write(f"\n# merge {row.name}\n")
                try:
                    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                        merge(config, out, overwrite=True, progress=False, print_summary=True)
                except RamTrlError as exc:
                    raise RamTrlError(f"merge {row.name!r} failed: {exc} (log: {log_path})") from exc
                done.append((row, out))
        self._timed("merges", start)
        self.console.print(
            f"[green]merges[/]: {len(done)} in {self.timings['merges']:.0f}s (log: {log.name})"
        )
        return done

    def eval_tasks(self) -> list[Any]:
        """Every stage's test and validation prompts with its rewards (stages without rows are left out).

        Returns:
            `list[EvalTask]`: The tasks, stage by stage.
        """
        from ram_trl.recipes.evaluate import EvalTask

        tasks = []
        for split, file in (("test", "eval.jsonl"), ("val", "val.jsonl")):
            for stage in self.recipe.stages:
                path = self.dir / "data" / stage.name / file
                rows = read_jsonl(path) if path.is_file() else []
                if rows and stage.rewards:
                    tasks.append(EvalTask(stage.name, rows, stage.rewards, split=split))
        return tasks

    def evaluate(self, merged: list[tuple[MergeRow, Path]]) -> list[dict[str, Any]]:
        """Score the base, every agent and every merge on each stage's test and validation prompts.

        Args:
            merged (`list[tuple[MergeRow, Path]]`): The merges (:meth:`merges`).

        Returns:
            `list[dict[str, Any]]`: One results row per model (empty when evaluation is disabled).
        """
        import json

        from ram_trl.recipes.evaluate import evaluate_model

        if not self.recipe.evaluation.enabled:
            return []
        tasks = self.eval_tasks()
        models: list[tuple[str, str, Path, str | None, dict[str, Any]]] = [
            ("base", "base", self.base, None, {})
        ]
        models += [(s.name, "agent", self.agent_path(s), None, {}) for s in self.recipe.stages]
        models += [(row.name, "merge", path, row.method, row.parameters) for row, path in merged]
        results = []
        start = time.perf_counter()
        (self.dir / "eval").mkdir(exist_ok=True)
        from tqdm.auto import tqdm

        for name, kind, path, method, parameters in tqdm(
            models, desc="evaluation", disable=not self.options.progress
        ):
            scored = evaluate_model(path, tasks, self.recipe.evaluation, base=self.base, progress=False)
            with atomic_file(self.dir / "eval" / f"{safe_name(name)}.json", "evaluation file") as tmp:
                tmp.write_text(json.dumps(scored, indent=2) + "\n", encoding="utf-8")
            val = scored["splits"].get("val", {"scores": {}, "n": {}, "rewards": {}})
            results.append(
                {
                    "name": name,
                    "kind": kind,
                    "method": method,
                    "parameters": parameters,
                    "path": str(path),
                    "scores": scored["scores"],
                    "n": scored["n"],
                    "rewards": scored["rewards"],
                    "val": {"scores": val["scores"], "n": val["n"], "rewards": val["rewards"]},
                }
            )
        self._timed("evaluation", start)
        return results

    def results(self, rows: list[dict[str, Any]], analysis: dict[str, Any] | None) -> dict[str, Any]:
        """Write ``results.json``, ``results.md`` and the figures, and print the table.

        Args:
            rows (`list[dict[str, Any]]`): The evaluated rows (:meth:`evaluate`).
            analysis (`dict[str, Any]`, *optional*): The analysis, for the agents' regime.

        Returns:
            `dict[str, Any]`: The results, statistics included.
        """
        from ram_trl.recipes.results import print_table, regime_from_analysis, write_results

        evaluation = self.recipe.evaluation
        decoding = (
            "greedy decoding"
            if not evaluation.do_sample
            else f"sampling at temperature {evaluation.temperature:g}"
        )
        results: dict[str, Any] = {
            "recipe": self.recipe.name,
            "description": self.recipe.description,
            "stages": [
                s.name for s in self.recipe.stages if read_jsonl(self.dir / "data" / s.name / "eval.jsonl")
            ],
            "specialists": {s.name: s.name for s in self.recipe.stages},
            "decoding": f"{decoding}, max_new_tokens={evaluation.max_new_tokens}, seed {evaluation.seed}",
            "eps": self.recipe.analysis.eps,
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
            "timings": self.timings,
            "notes": self.notes,
            "figures": [f"analysis/{f}" for f in (analysis or {}).get("figures", [])],
            "previews": self.previews(),
        }
        warm = self.warm_start_record()
        if warm is not None:
            results["warm_start"] = warm
        write_results(results, self.dir, figures=self.options.figures)
        print_table(results)
        self.console.print(f"results: {self.dir / 'results.md'}")
        return results

    def previews(self) -> dict[str, dict[str, Any]]:
        """Per stage trained with ``preview:``, the merge preview its manifest records (the step kept and why, and
        every preview's merged validation scores), for results.md."""
        from ram_trl.manifest import read_manifest

        out = {}
        for stage in self.recipe.stages:
            if stage.trained and stage.preview is not None and stage_complete(self.stage_dir(stage)):
                record = read_manifest(self.stage_dir(stage)).extra.get("preview")
                if record:
                    out[stage.name] = record
        return out

    def sweeps(self) -> list[dict[str, Any]]:
        """The merge entries that sweep a parameter: their label, swept parameters and row names.

        Returns:
            `list[dict[str, Any]]`: ``{"label", "parameters", "rows"}`` per sweep.
        """
        out = []
        for spec in self.recipe.merges:
            swept = [k for k, v in spec.parameters.items() if isinstance(v, list)]
            names = [r.name for r in expand_merges(self.recipe.model_copy(update={"merges": [spec]}))]
            if swept and len(names) > 1:
                out.append({"label": spec.name or spec.method, "parameters": swept, "rows": names})
        return out


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """What a child process runs before its program (``Popen(preexec_fn=...)``) so that it is terminated with its
    parent: on Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, so a runner killed even by ``kill -9`` takes its stage
    process down with it (and the stage's temporary directory is then removed by the next run).

    Args:
        parent (`int`): The parent's process id (a child whose parent is already gone exits at once).

    Returns:
        The function, or ``None`` where the operating system has no such request.
    """
    if not sys.platform.startswith("linux"):
        return None

    def request() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the request took effect
            os._exit(1)

    return request


_PR_SET_PDEATHSIG = 1


def _first_difference(recorded: Any, wanted: Any, path: str = "") -> str:
    """The first field where two JSON values differ, as ``path: recorded -> wanted``."""
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        for key in sorted(set(recorded) | set(wanted), key=str):
            if recorded.get(key) != wanted.get(key):
                return _first_difference(
                    recorded.get(key), wanted.get(key), f"{path}.{key}" if path else str(key)
                )
    return f"{path or 'record'}: {recorded!r} -> {wanted!r}"


def _stop(process: subprocess.Popen, grace: float = 10.0) -> None:
    """Terminate a child process (SIGTERM, then SIGKILL after ``grace`` seconds) and wait for it."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        return False


def run_recipe(
    recipe_path: str | os.PathLike | dict[str, Any], options: RunOptions | None = None
) -> dict[str, Any]:
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
    console = _console()
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
    out = options.out or (
        _resolve(recipe.output_dir, root) if recipe.output_dir else Path("runs") / recipe.name
    )
    if recipe.torch_threads is not None:
        import torch

        torch.set_num_threads(recipe.torch_threads)
    run = Run(recipe, root, Path(out).resolve(), options)
    run.notes.extend(notes)
    from ram_trl.recipes.stage import StageFailure

    try:
        run.prepare(recipe_file)
    except (ConfigError, StageFailure) as exc:  # the prompt rows and reward functions: name the recipe
        raise ConfigError(f"{where}: {exc}") from exc
    run.train_stages()
    if options.only is not None:
        console.print(
            f"stage {options.only} done; run without --only (with --resume) for the merges and evaluation"
        )
        return {"recipe": recipe.name, "only": options.only}
    analysis = run.analyze()
    merged = run.merges()
    rows_scored = run.evaluate(merged)
    run.timings["total"] = round(time.perf_counter() - total, 2)
    return run.results(rows_scored, analysis)


def run_seeds(recipe_path: str | os.PathLike | dict[str, Any], options: RunOptions) -> dict[str, Any]:
    """``ram-trl run --seeds N``: the whole pipeline ``N`` times, with the recipe's ``seed`` (the stages' trainers
    and the merges' random draws) and ``evaluation.seed`` set to ``seed + k`` for ``k = 0 .. N-1``, each run in
    ``OUT/seed_S/`` with its own ``results.md``; then ``OUT/results.md`` and ``results.json`` with every score the
    mean over the seeds and its 95% Student t interval over the seeds.

    The prompts (``prompts.seed``), the base and the warm start (``warm_start.seed``) are the same in every run (the
    base is built and warm-started once and copied), so the intervals measure how much the results vary with the
    RL training and the merges' randomness, not with the choice of prompts. A stage whose ``config.seed`` is set
    trains with that seed in every run (a note says so).

    Args:
        recipe_path (`str`, `os.PathLike` or `dict`): The recipe YAML (or its mapping).
        options (`RunOptions`): The run's options; ``options.seeds`` is ``N``.

    Returns:
        `dict[str, Any]`: The aggregated results (the content of ``OUT/results.json``).

    Raises:
        ConfigError: with ``--only`` (a seed run is a whole pipeline).
    """
    from dataclasses import replace

    from ram_trl.recipes.results import aggregate_seeds, print_table, write_results

    if options.only is not None:
        raise ConfigError("--seeds runs the whole pipeline once per seed; it does not combine with --only")
    recipe, root = load_recipe(recipe_path, options.overrides)
    out = Path(
        options.out
        or (_resolve(recipe.output_dir, root) if recipe.output_dir else Path("runs") / recipe.name)
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
        _console().print(f"[bold]seed {seed}[/] ({k + 1} of {len(seeds)}): {sub}")
        runs.append(run_recipe(recipe_path, replace(options, out=sub, seeds=1, overrides=overrides)))
    results = aggregate_seeds(runs, seeds)
    fixed = [s.name for s in recipe.stages if s.trained and "seed" in s.config]
    if fixed:
        results["notes"].append(
            f"stages {', '.join(fixed)} set config.seed: their training is the same in every seed run"
        )
    write_results(results, out, figures=options.figures)
    print_table(results)
    _console().print(f"results over {len(seeds)} seeds: {out / 'results.md'}")
    return results
