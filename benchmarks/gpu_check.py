"""One command for a GPU machine: does everything run on CUDA, byte-identical to the CPU, and how fast.

    python benchmarks/gpu_check.py            # on a machine with CUDA (one GPU, under 8 minutes on an H100)
    python benchmarks/gpu_check.py --smoke    # the same code paths on the CPU at tiny sizes (tests/test_gpu_check.py)

Prints one table (rich when installed) and, with ``--json PATH``, writes every row's figures. Rows:

- ``GRPO + telemetry``: a real TRL ``GRPOTrainer`` run (bf16 on CUDA, a Qwen2.5-0.5B-shaped model with random
  weights built from a config, its base on disk) with ``TaskVectorSparsityCallback`` at ``logging_steps`` 5 (the
  default interval): the median measure seconds, the median training step (timed from ``on_step_begin`` to
  ``on_step_end``, the measurement outside it; the first step left out), the overhead = measure / (interval x step)
  (target: at most 2%), and the check that the logged ``density_saved`` equals ``ram-trl analyze`` of the saved agent;
- ``GRPO + merge preview``: the same model and trainer, a prior stage of 2 steps, then a stage with
  ``MergePreviewCallback`` previewing every 2 steps: one preview's seconds (of which merge) against a step, and the
  check that ``ram-trl merge`` of the kept checkpoint with the prior is the previewed merge bit for bit;
- ``merge <method> --device cuda``: ``ram_trl.merge`` (what ``ram-trl merge`` runs) of 3 synthetic RL-like agents of
  853M params each (the GPU issue's size) on the GPU, against the GPU read floor (read every input once, move it to
  the GPU, upcast to float32; target: within 1.5x) and mergekit 0.1.5 ``--cuda --read-to-gpu --low-cpu-memory``
  in-process (``ram`` for ram_plus, ``ties`` for TIES; target: at least 2x faster), and the check that the output is
  byte-identical to the CPU merge's;
- ``merge <method> on the CPU``: the CPU merge (all cores, the thread plan of ``ram_trl.parallel.plan_threads``)
  against the single-threaded CPU read floor (target: within 1.5x);
- ``ram-trl run (one stage)``: ``ram-trl run RECIPE --only STAGE`` of a tiny recipe written here; it trains on CUDA
  when CUDA is present; the check is the stage manifest and, on CUDA, that the telemetry's base was resident on the GPU.

With ``--smoke`` the rows run on the CPU at tiny sizes (mergekit on the CPU): the code paths, no figures to report.
A row whose package is missing (trl, datasets, mergekit) says so instead of a number. Exit status 1 when a check fails
or a row errs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import json
import math
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for path in (REPO, HERE):  # this checkout's ram_trl; the training reward of bench_callback
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import ram_trl  # noqa: E402
from ram_trl.parallel import plan_threads  # noqa: E402
from ram_trl.synthetic import make_base_checkpoint, make_rl_agent  # noqa: E402

#: Qwen2.5-0.5B's shapes (GRPO rows) and an 853M-param Qwen2 (merges, the GPU issue's size); tiny ones for --smoke
SHAPES = {
    "grpo": dict(hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "merge": dict(hidden_size=2048, num_layers=16, intermediate_size=5632, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    "grpo_smoke": dict(hidden_size=64, num_layers=2, intermediate_size=128, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "merge_smoke": dict(hidden_size=64, num_layers=2, intermediate_size=128, num_attention_heads=4,
                        num_key_value_heads=2),
}  # fmt: skip
#: GRPO batch and steps on the GPU and with --smoke; ``interval`` = logging_steps = the telemetry's default interval
GRPO = {
    "gpu": dict(batch=8, generations=4, new_tokens=32, steps=11, interval=5, learning_rate=5e-5),
    "smoke": dict(batch=4, generations=4, new_tokens=8, steps=3, interval=2, learning_rate=1e-3),
}
#: the preview rows' validation prompts and evaluation
PREVIEW_PROMPTS = 8
#: the merge rows' agents: the share of each tensor's elements each one changes
DENSITIES = (0.05, 0.2, 0.4)
REWARD_PATH = "bench_callback:reward"
PROMPTS = ["ab", "cd", "ef", "gh"]


class Rows:
    """The table: one dict per row (``row``, the figures, ``check``: True / False / None)."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def run(self, name: str, fn: Callable[[], list[dict[str, Any]]]) -> None:
        """Append ``fn``'s rows; a missing package or an error becomes a row that says so."""
        start = time.perf_counter()
        try:
            rows = fn()
            rows[0]["group_wall_s"] = round(time.perf_counter() - start, 1)  # the rows' time, setup included
            self.rows += rows
        except ImportError as error:
            self.rows.append({"row": name, "note": f"skipped: {error} (see docs/development.md#gpu-check)"})
        except Exception as error:  # noqa: BLE001 - the other rows still run; the status says it failed
            traceback.print_exc()
            self.rows.append({"row": name, "check": False, "note": f"error: {type(error).__name__}: {error}"})
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()


def _median_seconds(fn: Callable[[], Any], repeats: int, clear: Path | None = None) -> float:
    """The median wall time of ``repeats`` calls of ``fn`` (``clear``, an output directory, removed before each)."""
    times = []
    for _ in range(repeats):
        if clear is not None:
            shutil.rmtree(clear, ignore_errors=True)
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _base(root: Path, name: str, smoke: bool) -> Path:
    """The rows' base checkpoint, built once per work directory (a marker file says it is complete)."""
    directory = root / f"{name}_base{'_smoke' if smoke else ''}"
    done = directory.with_name(directory.name + ".complete")
    if not done.is_file():
        shutil.rmtree(directory, ignore_errors=True)
        make_base_checkpoint(
            directory, materialize="eager" if smoke else "stream", **SHAPES[f"{name}_smoke" if smoke else name]
        )
        done.write_text("")
    return directory


def _fresh(directory: Path) -> Path:
    """``directory``, emptied (a row's output from an earlier run in the same work directory)."""
    shutil.rmtree(directory, ignore_errors=True)
    return directory


def _agents(root: Path, base: Path, smoke: bool) -> list[Path]:
    """The merge rows' synthetic RL agents (:func:`ram_trl.synthetic.make_rl_agent`, shared supports), built once per
    work directory: one process each (with ``smoke``, tiny ones in this process: starting a process costs more)."""
    folder = root / f"{base.name}_agents"
    agents = [folder / f"agent_{i}" for i in range(len(DENSITIES))]
    done = folder.with_name(folder.name + ".complete")
    if not done.is_file():
        shutil.rmtree(folder, ignore_errors=True)
        jobs = [
            (agent, {"density": density, "seed": 3 + i})
            for i, (agent, density) in enumerate(zip(agents, DENSITIES, strict=True))
        ]
        if smoke:
            for agent, settings in jobs:
                make_rl_agent(base, agent, **settings)
        else:
            workers = max(1, min(len(agents), plan_threads().cores))
            with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
                for future in [pool.submit(make_rl_agent, base, agent, **kw) for agent, kw in jobs]:
                    future.result()
        done.write_text("")
    return agents


# -- GRPO rows ---------------------------------------------------------------------------------------------------


def _step_timer() -> Any:
    """A trainer callback that times each optimizer step (``on_step_begin`` to ``on_step_end``; listed first, it
    stops before the ram_trl callbacks measure or preview)."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.seconds.append(time.perf_counter() - self._start)

    return StepTimer()


def _grpo(base: Path, out: Path, device: torch.device, smoke: bool, steps: int, callbacks: list[Any]) -> Any:
    """A TRL GRPOTrainer on ``base`` (bf16 weights and autocast on CUDA, float32 on the CPU), the callbacks bound to
    it; trained, and returned."""
    from bench_callback import reward
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    settings = GRPO["smoke" if smoke else "gpu"]
    cuda = device.type == "cuda"
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        logging_steps=settings["interval"],
        per_device_train_batch_size=settings["batch"],
        num_generations=settings["generations"],
        max_completion_length=settings["new_tokens"],
        learning_rate=settings["learning_rate"],
        beta=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=not cuda,
        bf16=cuda,
        model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=str(base),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS * (steps + 1) * settings["batch"]}),
        callbacks=callbacks,
    )
    for callback in callbacks:
        if hasattr(callback, "bind"):
            callback.bind(trainer)
    with contextlib.redirect_stdout(io.StringIO()):  # the trainer's log lines
        trainer.train()
    return trainer


def _steady(seconds: list[float]) -> float:
    """The median step, the first (warm-up: kernels, allocator) left out when there are others."""
    return statistics.median(seconds[1:] if len(seconds) > 1 else seconds)


def telemetry_rows(root: Path, device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    """GRPO with TaskVectorSparsityCallback at the default interval."""
    from ram_trl.callbacks import TaskVectorSparsityCallback

    settings = GRPO["smoke" if smoke else "gpu"]
    base = _base(root, "grpo", smoke)
    out = _fresh(root / "grpo_telemetry")
    timer = _step_timer()
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="gpu_check")
    trainer = _grpo(base, out, device, smoke, settings["steps"], [timer, callback])
    params = sum(p.numel() for p in trainer.model.parameters())
    trained_on = str(next(trainer.model.parameters()).device)
    tracker = callback.tracker
    measures = [m["task_vector/measure_seconds"] for _, m in tracker.history]
    logged = tracker.last["task_vector/density_saved"]
    del trainer
    saved = ram_trl.analyze(base, [out], eps=tracker.eps, progress=False, figures=False)["agents"][0]["density"]
    step = _steady(timer.seconds)
    measure = statistics.median(measures)
    overhead = 100 * measure / (settings["interval"] * step)
    return [
        {
            "row": "GRPO + telemetry callback",
            "params": params,
            "device": trained_on,
            "steps": len(timer.seconds),
            "interval": settings["interval"],
            "measured_steps": [s for s, _ in tracker.history],
            "step_s": round(step, 4),
            "measure_s": round(measure, 4),
            "measure_max_s": round(max(measures), 4),
            "overhead_pct": round(overhead, 2),
            "density_logged": logged,
            "density_saved_agent": saved,
            "base": tracker.base_description,
            "seconds": round(measure, 3),
            "against": f"step {step:.3f} s x {settings['interval']}",
            "ratio": f"{overhead:.2f}%",
            "target": "<= 2%",
            "check": logged == saved,
            "note": f"density logged {logged:.6g}, saved agent {saved:.6g}",
        }
    ]


def preview_rows(root: Path, device: torch.device, smoke: bool) -> list[dict[str, Any]]:
    """GRPO with MergePreviewCallback and one prior stage."""
    from ram_trl.callbacks import TaskVectorSparsityCallback
    from ram_trl.callbacks.preview import MergePreviewCallback
    from ram_trl.digest import weights_digest
    from ram_trl.evaluation.scoring import EvalTask
    from ram_trl.recipes.schema import EvaluationSpec

    base = _base(root, "grpo", smoke)
    prior = _fresh(root / "preview_prior")
    _grpo(base, prior, device, smoke, 2, [TaskVectorSparsityCallback(base_model=base, stage_name="prior")])
    tasks = [
        EvalTask(name, [{"prompt": f"{name[0]}{i}"} for i in range(PREVIEW_PROMPTS)], [REWARD_PATH])
        for name in ("prior", "stage")
    ]
    stage = _fresh(root / "preview_stage")
    timer = _step_timer()
    callback = MergePreviewCallback(
        base_model=base, prior_stages=[prior], stage_name="stage", tasks=tasks,
        evaluation=EvaluationSpec(max_new_tokens=8, batch_size=PREVIEW_PROMPTS), preview_every=2,
    )  # fmt: skip
    trainer = _grpo(base, stage, device, smoke, 4, [timer, callback])
    trained_on = str(next(trainer.model.parameters()).device)
    del trainer
    kept = next(r for r in callback.history if r["step"] == callback.kept_step)
    merged = root / "preview_check"
    with contextlib.redirect_stdout(io.StringIO()):
        ram_trl.merge(callback.merge_config(stage), merged, overwrite=True, progress=False)
    identical = weights_digest(merged) == kept["merged_sha256"]
    step = _steady(timer.seconds)
    preview = statistics.median(r["seconds"] for r in callback.history)
    merge = statistics.median(r["merge_seconds"] for r in callback.history)
    return [
        {
            "row": "GRPO + merge preview (1 prior)",
            "device": trained_on,
            "previews": len(callback.history),
            "step_s": round(step, 4),
            "preview_s": round(preview, 4),
            "merge_s": round(merge, 4),
            "reference_s": callback.reference_seconds,
            "kept_step": callback.kept_step,
            "seconds": round(preview, 3),
            "against": f"step {step:.3f} s (merge {merge:.2f} s)",
            "ratio": f"{preview / step:.1f} steps",
            "target": "-",
            "check": identical,
            "note": "ram-trl merge of the kept checkpoint = the preview's merge" + ("" if identical else ": DIFFERS"),
        }
    ]


# -- merges ------------------------------------------------------------------------------------------------------


def read_floor(paths: list[Path], device: torch.device) -> None:
    """Read every tensor of every input once (one thread), move it to ``device`` and upcast it to float32."""
    for path in paths:
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = reader.get_tensor(name)
                    if tensor.is_floating_point():
                        tensor.to(device).float()
    _sync(device)


def _configs(base: Path, agents: list[Path]) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Per method: (ram_trl's config, mergekit's config of the same kind of merge)."""
    weight = {"weight": 1 / len(agents), "density": 0.2}

    def config(method: str, parameters: dict[str, Any] | None = None, per_model: dict | None = None) -> dict:
        out: dict[str, Any] = {"merge_method": method, "base_model": str(base), "dtype": "bfloat16"}
        out["models"] = [{"model": str(a), **({"parameters": per_model} if per_model else {})} for a in agents]
        if parameters:
            out["parameters"] = parameters
        return out

    ties = config("ties", per_model=weight)
    return {"ram_plus": (config("ram_plus", {"r": 0.1, "alpha": 2.0}), config("ram")), "ties": (ties, ties)}


def _mergekit() -> Callable[[dict[str, Any], Path, torch.device], None]:
    """mergekit's in-process merge (raises ImportError without mergekit)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # mergekit 0.1.5 touches numpy.core at import
        from mergekit.config import MergeConfiguration
        from mergekit.merge import run_merge
        from mergekit.options import MergeOptions

    def run(config: dict[str, Any], out: Path, device: torch.device) -> None:
        cuda = device.type == "cuda"
        options = MergeOptions(
            device="cuda" if cuda else "cpu",
            read_to_gpu=cuda,
            low_cpu_memory=cuda,
            num_threads=plan_threads().cores,
            quiet=True,
        )
        threads = torch.get_num_threads()  # mergekit sets torch's threads for the process: keep ours
        try:
            configuration = MergeConfiguration.model_validate(json.loads(json.dumps(config)))
            run_merge(configuration, str(out), options=options)
        finally:
            torch.set_num_threads(threads)

    return run


def merge_rows(root: Path, device: torch.device, smoke: bool, repeats: int) -> list[dict[str, Any]]:
    """ram_trl.merge on the device and on the CPU, the read floors, mergekit."""
    base = _base(root, "merge", smoke)
    agents = _agents(root, base, smoke)
    inputs = [base, *agents]
    cpu = torch.device("cpu")
    floors = {"cpu": _median_seconds(lambda: read_floor(inputs, cpu), repeats)}
    if device.type != "cpu":
        floors[device.type] = _median_seconds(lambda: read_floor(inputs, device), repeats)
    try:
        mergekit = _mergekit()
        missing = None
    except ImportError as error:
        mergekit, missing = None, f"mergekit not importable ({error}); pip install 'ram-trl[mergekit]'"
    plan = plan_threads()
    rows = []
    for method, (ours, theirs) in _configs(base, agents).items():
        seconds: dict[str, float] = {}
        reports: dict[str, dict[str, Any]] = {}
        runs = {"cpu": "cpu", device.type: device.type}
        if device.type != "cpu" and method == "ram_plus":
            runs["no cache"] = device.type  # the same merge reading its inputs twice (--input-cache off)
        for key, where in runs.items():
            out = root / f"{method}_{key.replace(' ', '_')}"

            def run(
                key: str = key, where: str = where, out: Path = out, config: dict = ours, reports: dict = reports
            ) -> None:
                cache = "off" if key == "no cache" else "auto"
                with contextlib.redirect_stdout(io.StringIO()):  # the merge's own report table
                    reports[key] = ram_trl.merge(
                        config, out, overwrite=True, device=where, progress=False, input_cache=cache
                    )
                _sync(torch.device(where))

            seconds[key] = _median_seconds(run, repeats, clear=out)
        device_files = sorted((root / f"{method}_{device.type}").glob("*.safetensors"))
        identical = bool(device_files) and all(
            (root / f"{method}_cpu" / f.name).read_bytes() == f.read_bytes() for f in device_files
        )
        theirs_s = None
        if mergekit is not None:
            out = root / f"{method}_mergekit"
            theirs_s = _median_seconds(
                lambda out=out, config=theirs: mergekit(config, out, device), repeats, clear=out
            )
        ours_s, floor = seconds[device.type], floors[device.type]
        name = theirs["merge_method"]
        versus = f"floor {floor:.2f} s"
        ratio = f"{ours_s / floor:.2f}x floor"
        if theirs_s is not None:
            versus += f", mergekit {name} {theirs_s:.2f} s"
            ratio += f", {theirs_s / ours_s:.2f}x faster"
        kept = reports[device.type].get("input_cache")
        cache_note = ""
        if kept is not None:
            cache_note = f"; input cache kept {kept['kept_bytes'] / 1e9:.2f} GB"
            if "no cache" in seconds:
                cache_note += f" (without it: {seconds['no cache']:.2f} s)"
        rows.append(
            {
                "row": f"merge {method} --device {device.type}",
                "params_per_model": _params(base),
                "seconds": round(ours_s, 3),
                "read_floor_s": round(floor, 3),
                "x_floor": round(ours_s / floor, 2),
                f"mergekit_{name}_s": None if theirs_s is None else round(theirs_s, 3),
                "x_faster_than_mergekit": None if theirs_s is None else round(theirs_s / ours_s, 2),
                "byte_identical_to_cpu": identical,
                "input_cache": kept,
                "seconds_without_input_cache": None if "no cache" not in seconds else round(seconds["no cache"], 3),
                "against": versus,
                "ratio": ratio,
                "target": "<= 1.5x floor, >= 2x faster",
                "check": identical,
                "note": ("byte-identical to the CPU merge" if identical else "NOT byte-identical to the CPU merge")
                + cache_note
                + (f"; {missing}" if missing else ""),
            }
        )
        # the CPU merge on every core against the one-thread CPU read floor (with --smoke: the device row's run)
        rows.append(
            {
                "row": f"merge {method} on the CPU ({plan.cores} cores)",
                "seconds": round(seconds["cpu"], 3),
                "read_floor_s": round(floors["cpu"], 3),
                "x_floor": round(seconds["cpu"] / floors["cpu"], 2),
                "against": f"floor {floors['cpu']:.2f} s (one thread)",
                "ratio": f"{seconds['cpu'] / floors['cpu']:.2f}x floor",
                "target": "<= 1.5x floor",
                "check": None,
                "note": f"thread plan: {plan}",
            }
        )
    return rows


def _params(model_dir: Path) -> int:
    count = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as reader:
            count += sum(math.prod(reader.get_slice(name).get_shape()) for name in reader.keys())  # noqa: SIM118
    return count


# -- ram-trl run -------------------------------------------------------------------------------------------------

RECIPE = """\
name: gpu-check
seed: 0
base:
  build: {hidden_size: 64, num_layers: 2, intermediate_size: 128, num_attention_heads: 4, num_key_value_heads: 2,
          dtype: bfloat16, seed: 0}
stages:
  - name: check
    prompts: {generator: "ram_trl.recipes.tasks:arithmetic_prompts", train_size: 16, seed: 0}
    rewards: ["tests.helpers:distinct_chars"]
    trainer: grpo
    config: {max_steps: 3, per_device_train_batch_size: 4, num_generations: 4, max_completion_length: 8,
             logging_steps: 1, learning_rate: 1.0e-3}
    save_dtype: bfloat16
"""


def run_rows(root: Path, device: torch.device) -> list[dict[str, Any]]:
    """``ram-trl run RECIPE --only check`` of a tiny recipe (its stage trains on CUDA when CUDA is present)."""
    cuda = device.type == "cuda"
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)  # TRL's bf16 default holds on CUDA (the recipes turn it off without a GPU)
    out = _fresh(root / "run")
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}  # this checkout; the recipe's reward (tests.helpers)
    command = [sys.executable, "-m", "ram_trl", "run", str(recipe), "--only", "check", "--out", str(out)]
    start = time.perf_counter()
    done = subprocess.run(
        [*command, "--no-progress", "--no-figures"], capture_output=True, text=True, env=env, timeout=600
    )
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        return [{"row": "ram-trl run (one stage)", "check": False, "note": f"exit {done.returncode}"}]
    manifest = json.loads((out / "stages" / "check" / "ram_stage.json").read_text())
    source = manifest["extra"]["telemetry"]["base_source"]
    on_device = "resident on cuda" in source
    return [
        {
            "row": "ram-trl run (one stage)",
            "seconds": round(seconds, 2),
            "steps": manifest["steps"],
            "density_saved": manifest["telemetry"]["task_vector/density_saved"],
            "base": source,
            "against": "-",
            "ratio": "-",
            "target": "-",
            "check": on_device if cuda else True,
            "note": f"stage manifest written; telemetry base: {source}",
        }
    ]


# -- the table ---------------------------------------------------------------------------------------------------

COLUMNS = ("row", "seconds", "against", "ratio", "target", "check", "note")


def _cell(row: dict[str, Any], column: str) -> str:
    value = row.get(column)
    if column == "check":
        return {True: "ok", False: "FAIL", None: "-"}[value]
    return "-" if value is None else str(value)


def print_table(rows: list[dict[str, Any]], title: str) -> None:
    """One table: rich when installed, else plain text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(" | ".join(COLUMNS))
        for row in rows:
            print(" | ".join(_cell(row, c) for c in COLUMNS))
        return
    table = Table(title=title, title_justify="left")
    for column in COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*(_cell(row, c) for c in COLUMNS))
    Console(width=200).print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (the code paths, no figures)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per merge timing (median; default 2)")
    parser.add_argument("--only", default="telemetry,preview,merge,run", help="rows to run (default: all of them)")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the generated models here and reuse them on the next run (default: a temporary directory)",
    )
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU code paths", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    repeats = 1 if args.smoke else args.repeats
    wanted = set(args.only.split(","))
    started = time.perf_counter()
    table = Rows()
    with contextlib.ExitStack() as stack:
        if args.workdir is None:
            root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ram_trl_gpu_check_")))
        else:
            root = args.workdir
            root.mkdir(parents=True, exist_ok=True)
        if "telemetry" in wanted:
            table.run("GRPO + telemetry callback", lambda: telemetry_rows(root, device, args.smoke))
        if "preview" in wanted:
            table.run("GRPO + merge preview (1 prior)", lambda: preview_rows(root, device, args.smoke))
        if "merge" in wanted:
            table.run("merge", lambda: merge_rows(root, device, args.smoke, repeats))
        if "run" in wanted:
            table.run("ram-trl run (one stage)", lambda: run_rows(root, device))
    plan = plan_threads()
    machine = torch.cuda.get_device_name() if cuda else "CPU only (smoke)"
    title = (
        f"gpu_check on {machine}; {plan.cores} cores; torch {torch.__version__}; {time.perf_counter() - started:.0f} s"
    )
    print_table(table.rows, title)
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine, "title": title, "rows": table.rows}, indent=2))
    failed = [r["row"] for r in table.rows if r.get("check") is False]
    if failed:
        print(f"FAILED: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
