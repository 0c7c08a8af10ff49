"""Stage launching for ``ram-trl run``: each trained stage in its own process, committed on its manifest."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ram_trl.errors import ConfigError, RamTrlError
from ram_trl.io.json_files import json_object_or_none
from ram_trl.output import OutputDir
from ram_trl.recipes.layout import RunLayout, resolve_path, stage_complete
from ram_trl.recipes.progress import Progress, parse_step
from ram_trl.recipes.schema import StageSpec

__all__ = ["STAGE_RECORD", "StageError", "StageLauncher", "die_with_parent"]

STAGE_RECORD = "ram_recipe_stage.json"  #: What a stage was trained with (``--resume`` compares it with the recipe).


class StageError(RamTrlError):
    """A stage process failed; the message names the stage, its exit code, its last error line and its log."""


class StageLauncher:
    """Training a run's stages, each in its own process (a part of :class:`~ram_trl.recipes.runner.Run`)."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout

    def train_stages(self) -> None:
        """Train every stage without a given checkpoint (``options.only``, ``options.resume`` honoured)."""
        stages = [s for s in self.layout.recipe.stages if s.trained]
        if self.layout.options.only is not None:
            self.layout.recipe.stage(self.layout.options.only)
            stages = [s for s in stages if s.name == self.layout.options.only]
            if not stages:
                raise ConfigError(
                    f"stage {self.layout.options.only!r} has an existing checkpoint; there is nothing to train"
                )
        for stage in stages:
            if self.layout.options.resume and stage_complete(self.layout.stage_dir(stage)):
                self.check_recorded_stage(stage)
                self.layout.console.print(
                    f"[cyan]skip[/] stage {stage.name}: complete ({self.layout.stage_dir(stage)})"
                )
                continue
            self.train_stage(stage)

    def _prior(self, stage: StageSpec) -> list[Path]:
        from ram_trl.stage.manifest import MANIFEST_NAME

        prior = []
        for other in self.layout.recipe.stages:
            if other.name == stage.name:
                break
            if other.trained and stage_complete(self.layout.stage_dir(other)):
                prior.append(self.layout.stage_dir(other) / MANIFEST_NAME)
        return prior

    def stage_command(self, stage: StageSpec, work: Path | None = None) -> list[str]:
        """The stage process's command line; it writes into ``work`` (default: the stage directory)."""
        args = [
            "--recipe",
            str(self.layout.dir / "recipe.yaml"),
            "--stage",
            stage.name,
            "--base",
            str(self.layout.base),
            "--train-file",
            str(self.layout.dir / "data" / stage.name / "train.jsonl"),
            "--out",
            str(work or self.layout.stage_dir(stage)),
        ]
        prior = self._prior(stage)
        if prior:
            args += ["--prior", *map(str, prior)]
        if stage.preview is not None:
            merged = [p.parent.name for p in prior] + [stage.name]
            args += ["--val", *(f"{name}={self.layout.dir / 'data' / name / 'val.jsonl'}" for name in merged)]
        if stage.accelerate_config is None:
            return [sys.executable, "-m", "ram_trl.recipes.stage", *args]
        config = resolve_path(stage.accelerate_config, self.layout.root)
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
        """The stage directory's commit protocol: a previous run of the stage is replaced, anything else refused."""
        from ram_trl.stage.manifest import MANIFEST_NAME

        reads = [("base model", self.layout.base)] + [
            (f"stage {other.name!r} agent", self.layout.agent_path(other))
            for other in self.layout.recipe.stages
            if other.name != stage.name
        ]
        reads += [(f"stage {stage.name!r} prompt files", self.layout.dir / "data" / stage.name)]
        return OutputDir(
            self.layout.stage_dir(stage),
            markers=(MANIFEST_NAME,),
            replace_previous=True,
            reads=reads,
            what=f"stage {stage.name!r} directory",
        )

    def stage_record(self, stage: StageSpec) -> dict[str, Any]:
        """What a stage was trained with (kept in ``STAGE/ram_recipe_stage.json``): its spec and the run's seed."""
        return {"stage": stage.model_dump(mode="json"), "seed": self.layout.recipe.seed}

    def check_recorded_stage(self, stage: StageSpec) -> None:
        """Refuse to ``--resume`` over a finished stage trained with another config than the recipe's."""
        file = self.layout.stage_dir(stage) / STAGE_RECORD
        if not file.is_file():
            return  # a stage finished before records were kept
        recorded = json_object_or_none(file)
        wanted = json.loads(json.dumps(self.stage_record(stage)))
        if recorded != wanted:
            field = _first_difference(recorded, wanted)
            raise ConfigError(
                f"--resume: stage {stage.name!r} in {self.layout.stage_dir(stage)} was trained with another config than the "
                f"recipe's ({field}); retrain it with --only {stage.name}, or restore the recipe"
            )

    def train_stage(self, stage: StageSpec) -> None:
        """Train one stage in its own process and commit its directory when it finished with a manifest."""
        out = self.layout.stage_dir(stage)
        output = self.stage_output(stage)
        work = output.begin()  # removes a killed run's leftovers of this stage
        try:
            (work / STAGE_RECORD).write_text(json.dumps(self.stage_record(stage), indent=2, sort_keys=True) + "\n")
            code, log, tail, started = self._run_stage_process(stage, work)
            complete = code == 0 and stage_complete(work)
            if complete:
                output.commit()
        except BaseException:
            output.abort()
            raise
        if not complete:
            output.abort()  # a failed stage leaves nothing behind; a previous result, if any, is kept as it was
        self.layout.timed(f"stage:{stage.name}", started)
        if not complete:
            errors = [t for t in tail if "error" in t.lower()]
            reason = errors[-1] if errors else (tail[-1] if tail else "no output")
            done = [
                s.name
                for s in self.layout.recipe.stages
                if s.trained and s.name != stage.name and stage_complete(self.layout.stage_dir(s))
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
        self.layout.console.print(
            f"[green]stage[/] {stage.name}: done in {self.layout.timings[f'stage:{stage.name}']:.0f}s"
            f"{stage_processes(out)} -> {out}"
        )

    def _run_stage_process(self, stage: StageSpec, work: Path) -> tuple[int, Path, deque[str], float]:
        """Run the stage process writing into ``work``; returns its exit code, log, last lines and start time."""
        log = self.layout.dir / "logs" / f"{stage.name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        command = self.stage_command(stage, work)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        # its output goes to a log file: no progress bars (each redraw would be a line of the log)
        env.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if self.layout.recipe.torch_threads is not None:
            env["OMP_NUM_THREADS"] = str(self.layout.recipe.torch_threads)
        if not _has_cuda():
            env.setdefault("ACCELERATE_USE_CPU", "1")
        start = time.perf_counter()
        tail: deque[str] = deque(maxlen=40)
        steps: Progress | None = None
        with (
            open(log, "w", encoding="utf-8") as handle,
            self.layout.console.status(f"stage {stage.name}: starting") as status,
        ):
            handle.write("$ " + " ".join(command) + "\n")
            process = subprocess.Popen(
                command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                cwd=str(self.layout.root),
                env=env,
                bufsize=1,
                preexec_fn=die_with_parent(os.getpid()),
            )
            try:
                assert process.stdout is not None
                for line in process.stdout:
                    handle.write(line)
                    text = line.strip()
                    step = parse_step(text)
                    if step is not None:  # the training steps: a bar with an ETA, or lines in a log file
                        if steps is None:
                            status.stop()
                            steps = Progress(
                                f"stage {stage.name}: step",
                                step[1],
                                bar=self.layout.options.progress,
                                write=self.layout.say,
                                every_item=False,
                            )
                        steps.update(step[0])
                    elif text:
                        tail.append(text)
                        if steps is None:
                            status.update(f"stage {stage.name} ({time.perf_counter() - start:.0f}s): {text[-100:]}")
                code = process.wait()
            except BaseException:  # interrupted: stop the stage process before its directory is removed
                _stop(process)
                raise
            finally:
                if steps is not None:
                    steps.close()
        return code, log, tail, start


def stage_processes(stage_dir: Path) -> str:
    """`` on N processes`` as the stage's manifest records how many processes trained it (``""`` if it does not)."""
    from ram_trl.messages import processes_phrase
    from ram_trl.stage.manifest import read_manifest

    count = read_manifest(stage_dir).processes
    return "" if count is None else f" on {processes_phrase(count)}"


def die_with_parent(parent: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with its parent (Linux ``PR_SET_PDEATHSIG``, even on ``kill -9``)."""
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
                return _first_difference(recorded.get(key), wanted.get(key), f"{path}.{key}" if path else str(key))
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
