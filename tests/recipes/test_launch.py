"""Stage launching (ram_trl/recipes/launch.py): the stage process's command line, and a stage process that dies
with its runner. A failing stage, resume and the stage records run end to end in test_runner.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest

from ram_trl.recipes.progress import STEP_MARK, parse_step, step_lines
from ram_trl.recipes.runner import Run, RunOptions
from ram_trl.recipes.schema import load_recipe
from tests.helpers import recipe_dict


def test_stage_command_runs_the_stage_module_on_the_run_files(tmp_path):
    """The stage process is ``python -m ram_trl.recipes.stage`` on the run's recipe, base and training prompts, writing
    into the directory it is given; with an accelerate config, the same module under ``accelerate launch``; the
    module's entry point starts."""
    recipe, root = load_recipe(recipe_dict())
    run = Run(recipe, root, tmp_path / "run", RunOptions(progress=False))
    stage = recipe.stages[0]
    files = [
        "--recipe",
        str(tmp_path / "run" / "recipe.yaml"),
        "--stage",
        "coding",
        "--base",
        str(tmp_path / "run" / "base_init"),
        "--train-file",
        str(tmp_path / "run" / "data" / "coding" / "train.jsonl"),
    ]
    module = [sys.executable, "-m", "ram_trl.recipes.stage"]
    assert run.launcher.stage_command(stage) == [*module, *files, "--out", str(tmp_path / "run" / "stages" / "coding")]
    assert run.launcher.stage_command(stage, tmp_path / "work") == [*module, *files, "--out", str(tmp_path / "work")]
    recipe, root = load_recipe(recipe_dict(stages={"*": {"accelerate_config": str(tmp_path / "cpu.yaml")}}))
    launched = Run(recipe, root, tmp_path / "run", RunOptions(progress=False)).launcher.stage_command(recipe.stages[0])
    assert launched[:5] == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(tmp_path / "cpu.yaml"),
    ]
    assert launched[5:] == [
        "-m",
        "ram_trl.recipes.stage",
        *files,
        "--out",
        str(tmp_path / "run" / "stages" / "coding"),
    ]
    done = subprocess.run([*module, "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--train-file" in done.stdout, done.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stage_process_dies_with_a_runner_killed_by_sigkill(tmp_path):
    """The runner's stage processes are started with die_with_parent: kill -9 of the runner leaves no orphan."""
    middle = (
        "import os, subprocess, sys, time\n"
        "from ram_trl.recipes.launch import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " preexec_fn=die_with_parent(os.getpid()))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    runner = subprocess.Popen([sys.executable, "-c", middle], stdout=subprocess.PIPE, text=True)
    child = int(runner.stdout.readline())
    os.kill(runner.pid, signal.SIGKILL)
    runner.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        with contextlib.suppress(ChildProcessError):
            os.waitpid(child, os.WNOHANG)
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail(f"stage process {child} outlived its runner")


def test_a_stage_processes_steps_become_progress_lines_in_a_log_file(tmp_path, monkeypatch, capsys):
    """Without a terminal the launcher turns the stage process's step lines into a line at each tenth of the steps
    (no bar, no carriage return); the stage log keeps every line, the failure tail only the others."""
    recipe, root = load_recipe(recipe_dict())
    run = Run(recipe, root, tmp_path / "run", RunOptions(progress=False))
    stage = recipe.stages[0]
    script = "print('loading', flush=True)\n" + "".join(
        f"print({f'{STEP_MARK} step {n}/20'!r}, flush=True)\n" for n in range(1, 21)
    )
    monkeypatch.setattr(run.launcher, "stage_command", lambda *_: [sys.executable, "-c", script])
    code, log, tail, _ = run.launcher._run_stage_process(stage, tmp_path)
    err = capsys.readouterr().err
    assert code == 0 and list(tail) == ["loading"]
    lines = [line for line in err.splitlines() if line.startswith(f"stage {stage.name}: step ")]
    assert [line.split(" (")[0] for line in lines] == [f"stage {stage.name}: step {n}/20" for n in range(2, 21, 2)]
    assert "left)" in lines[0] and "left" not in lines[-1] and "\r" not in err
    assert sum(line.startswith(STEP_MARK) for line in log.read_text().splitlines()) == 20


def test_step_lines_print_the_first_and_last_step_and_at_most_one_line_per_interval(capsys):
    from transformers import TrainerState

    callback = step_lines(interval=3600)
    for step in range(1, 6):
        callback.on_step_end(None, TrainerState(global_step=step, max_steps=5), None)
    assert capsys.readouterr().out.splitlines() == [f"{STEP_MARK} step 1/5", f"{STEP_MARK} step 5/5"]
    assert parse_step(f"{STEP_MARK} step 3/40\n") == (3, 40) and parse_step("step 3/40") is None
