"""Overhead of TaskVectorSparsityCallback on GRPO training wall time, at the default measurement interval.

For every size preset this script builds a Qwen2-shaped base from a config (random init, bf16 on disk, a character
tokenizer; cached in ``WORKDIR/SIZE/base``), then runs, interleaved, GRPO training of ``--steps`` steps (TRL
GRPOTrainer, fp32 on the CPU, beta 0, the default ``logging_steps`` of 10) without and with the callback
(``base_model`` = the base on disk, read through memory maps; default interval = logging_steps; magnitude
statistics on). Each run is timed around ``trainer.train()``; the callback's measurements report their own
``task_vector/measure_seconds`` and the end-of-run save (agent in bf16 + ``ram_stage.json``) is timed separately.

Overhead = (median train() wall with callback - median without) / median without. The callback's own accounted
time (sum of measure_seconds + final save) is reported beside it, as wall times on a shared 2-core machine are noisy.

Usage::

    python benchmarks/bench_callback.py --sizes tiny,0.5b --workdir /tmp/bench_callback --report BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

#: Qwen2 shapes: hidden, layers, intermediate, heads, kv heads, vocab, tied embeddings.
SIZES = {
    "tiny": dict(
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
        tie_word_embeddings=False,
    ),
    # the model of the embedded CPU demo (recipes/demo-cpu.yaml)
    "demo": dict(
        hidden_size=128,
        num_layers=4,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=None,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-0.5B's shapes
    "0.5b": dict(
        hidden_size=896,
        num_layers=24,
        intermediate_size=4864,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
}
#: GRPO settings per size where they differ from the defaults of :func:`run` (batch 4 = 1 prompt x 4 generations,
#: 8 new tokens, lr 1e-5): the demo preset trains like a stage of recipes/demo-cpu.yaml, on one torch thread as there.
TRAINER = {
    "demo": dict(per_device_train_batch_size=32, num_generations=8, max_completion_length=24, learning_rate=2e-5)
}
TORCH_THREADS = {"demo": 1}
SECTION_START = "<!-- bench_callback:start -->"
SECTION_END = "<!-- bench_callback:end -->"


def make_base(workdir: Path, size: str) -> Path:
    from ram_trl.synthetic import make_base_checkpoint

    directory = workdir / size / "base"
    if (directory / "config.json").is_file():
        return directory
    return make_base_checkpoint(directory, materialize="stream", **SIZES[size])


def reward(completions, completion_ids=None, **kwargs) -> list[float]:
    """Share of even token ids in each completion.

    Computed on the ids, not the text: a random-init model with a 152K vocabulary mostly generates ids that the
    character tokenizer decodes to nothing, and a text reward would then be 0 everywhere (every advantage 0, no weight
    moves). This one varies within each group, so every step has non-zero advantages and the task vector is dense.
    """
    if completion_ids is None:
        return [float(len(set(c))) for c in completions]
    return [sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) for ids in completion_ids]


def run(base: Path, out: Path, steps: int, with_callback: bool, size: str = "") -> dict:
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ram_trl.callbacks import TaskVectorSparsityCallback

    timings: dict[str, float] = {}

    class TimedCallback(TaskVectorSparsityCallback):
        def on_train_end(self, args, state, control, **kwargs):
            started = time.perf_counter()
            super().on_train_end(args, state, control, **kwargs)
            timings["end_seconds"] = time.perf_counter() - started

    settings = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-5)
    settings.update(TRAINER.get(size, {}))
    torch.set_num_threads(TORCH_THREADS.get(size, os.cpu_count() or 1))
    args = GRPOConfig(
        output_dir=str(out),
        max_steps=steps,
        report_to=[],
        **settings,
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    # bf16 save, as in every table of BENCHMARKS.md (the default "auto" saves this float32 run in float32)
    callbacks = [TimedCallback(base_model=base, save_dtype="bfloat16")] if with_callback else []
    trainer = GRPOTrainer(
        model=str(base),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"] * (steps + 1) * 8}),
        callbacks=callbacks,
    )
    for cb in callbacks:
        cb.bind(trainer)
    started, cpu_started = time.perf_counter(), time.process_time()
    trainer.train()
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    result = {"wall": wall, "cpu": cpu, "logging_steps": args.logging_steps, "steps": trainer.state.global_step}
    if with_callback:
        tracker = callbacks[0].tracker
        measures = [m["task_vector/measure_seconds"] for _, m in tracker.history]
        result.update(
            measures=measures,
            measured_steps=[s for s, _ in tracker.history],
            end_seconds=timings.get("end_seconds", 0.0),
            state_mb=tracker.state_bytes / 2**20,
            density=tracker.last["task_vector/density"],
            density_saved=tracker.last["task_vector/density_saved"],
            numel=tracker.last["task_vector/numel"],
        )
    del trainer
    return result


def bench(size: str, workdir: Path, steps: int, repeats: int, warmup: bool) -> dict:
    base = make_base(workdir, size)
    runs: dict[str, list[dict]] = {"without": [], "with": []}
    if warmup:  # the first run in a process pays one-off costs (imports, kernels, page cache): discarded
        print(
            f"{size} warm-up: {json.dumps(run(base, workdir / size / 'out_warmup', steps, False, size))}", flush=True
        )
    for r in range(repeats):
        for variant in ("without", "with"):
            out = workdir / size / f"out_{variant}_{r}"
            result = run(base, out, steps, variant == "with", size)
            runs[variant].append(result)
            print(f"{size} {variant} #{r}: {json.dumps(result)}", flush=True)
    return {"size": size, "steps": steps, "repeats": repeats, "runs": runs}


def summarise(result: dict) -> dict:
    cpu_without = statistics.median(r["cpu"] for r in result["runs"]["without"])
    cpu_with = statistics.median(r["cpu"] for r in result["runs"]["with"])
    without = statistics.median(r["wall"] for r in result["runs"]["without"])
    with_cb = statistics.median(r["wall"] for r in result["runs"]["with"])
    measures = [m for r in result["runs"]["with"] for m in r["measures"]]
    end = statistics.median(r["end_seconds"] for r in result["runs"]["with"])
    last = result["runs"]["with"][-1]
    per_run_measure = statistics.median(sum(r["measures"]) for r in result["runs"]["with"])
    return {
        "size": result["size"],
        "numel": int(last["numel"]),
        "steps": result["steps"],
        "logging_steps": last["logging_steps"],
        "measured_steps": last["measured_steps"],
        "without": without,
        "with": with_cb,
        "overhead_pct": 100 * (with_cb - without) / without,
        "cpu_without": cpu_without,
        "cpu_with": cpu_with,
        "cpu_overhead_pct": 100 * (cpu_with - cpu_without) / cpu_without,
        "step_seconds": without / result["steps"],
        "measure_median": statistics.median(measures),
        "measure_max": max(measures),
        "measure_total": per_run_measure,
        "accounted_pct": 100 * (per_run_measure + end) / without,
        "measure_pct": 100 * per_run_measure / without,
        "end_seconds": end,
        "state_mb": last["state_mb"],
        "density": last["density"],
        "density_saved": last["density_saved"],
    }


def load_note(load: tuple[float, float], cpus: int) -> str:
    """Says what the load averages around the runs mean for their wall times.

    Args:
        load: the 1-minute load average before and after the runs.
        cpus: the machine's CPU count.

    Returns:
        A clause for the report's machine line: the benchmark itself keeps up to about `cpus` busy, so a load above
        that means other processes shared the CPUs.
    """
    if max(load) > cpus + 0.5:
        return "other processes shared the CPUs: wall times are noisy; the CPU-time column is less affected"
    return "no more than the benchmark itself keeps busy: the machine was otherwise idle"


def markdown(rows: list[dict], command: str, started: str, finished: str, load: tuple[float, float]) -> str:
    import ram_trl

    lines = [
        SECTION_START,
        "## Telemetry callback overhead on GRPO training (benchmarks/bench_callback.py)",
        "",
        f"- Date: {started} to {finished}; command: `{command}`",
        f"- Machine: {os.cpu_count()} CPUs, {platform.platform()}; torch {torch.__version__}, "
        f"ram_trl {ram_trl.__version__}; 1-minute load average {load[0]:.2f} before, {load[1]:.2f} after "
        f"({load_note(load, os.cpu_count() or 1)}).",
        "- Each run: TRL GRPOTrainer, fp32 on the CPU, batch 4 (1 prompt x 4 generations), 8 new tokens, beta 0, "
        "lr 1e-5, default `logging_steps` (10) (*demo*: the model and GRPO settings of a stage of "
        "`recipes/demo-cpu.yaml`: batch 32 = 4 prompts x 8 generations, 24 new tokens, lr 2e-5, one torch thread); "
        "the callback with `base_model` = the bf16 base on disk (memory-mapped), "
        "default interval (= logging_steps, plus the final step), magnitude statistics on. Without / with runs "
        "interleaved after a discarded warm-up run (sizes in `--warmup`); medians over the repeats. Base: random init "
        "from a Qwen2 config, bf16, character tokenizer. Reward: the share of even token ids in each completion, so "
        "rewards vary within every group and every step moves the weights (the task vector is dense: the worst case "
        "for the magnitude statistics).",
        "- *overhead (wall)*: (median train() wall with the callback - without) / without; *overhead (CPU "
        "time)*: the same with the process's CPU time (all threads), less sensitive to other processes. *accounted*: the callback's own "
        "time (its measurements' `task_vector/measure_seconds` + the end-of-run bf16 save and manifest) / the "
        "wall without; unlike the wall difference it is not blurred by other processes. *extra memory*: what the "
        "tracker keeps between measurements (0: the base is memory-mapped, no snapshot).",
        "",
        "| model | elements | steps | s/step | measured at | measure s (median / max) | train() without | "
        "train() with | overhead (wall) | overhead (CPU time) | measurements | end save | accounted | extra memory | "
        "final density (eps / bf16) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['size']} | {r['numel']:,} | {r['steps']} | {r['step_seconds']:.2f} | "
            f"{', '.join(map(str, r['measured_steps']))} | {r['measure_median']:.3f} / {r['measure_max']:.3f} | "
            f"{r['without']:.1f} s | {r['with']:.1f} s | {r['overhead_pct']:+.1f}% | {r['cpu_overhead_pct']:+.1f}% | "
            f"{r['measure_pct']:.1f}% | "
            f"{r['end_seconds']:.1f} s | {r['accounted_pct']:.1f}% | {r['state_mb']:.0f} MB | "
            f"{100 * r['density']:.1f}% / {100 * r['density_saved']:.1f}% |"
        )
    lines += [
        "",
        "Target: at most 5% at the default interval. *measurements* is the share of the measurements alone "
        "(what a longer run converges to: one measurement per `logging_steps` steps); *accounted* adds the one-off "
        "save at train end, which a short run amortises over few steps.",
        SECTION_END,
        "",
    ]
    return "\n".join(lines)


def write_section(report: Path, text: str) -> None:
    """Replace this benchmark's section of the report (between the markers), or append it."""
    existing = report.read_text() if report.is_file() else ""
    if SECTION_START in existing and SECTION_END in existing:
        head, rest = existing.split(SECTION_START, 1)
        tail = rest.split(SECTION_END, 1)[1].lstrip("\n")
        updated = head + text + tail
    else:
        updated = existing.rstrip("\n") + "\n\n" + text
    report.write_text(updated)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="tiny,demo,0.5b")
    parser.add_argument("--steps", default="tiny=20,demo=30,0.5b=10", help="steps per size, e.g. tiny=20,0.5b=10")
    parser.add_argument("--repeats", default="tiny=3,demo=3,0.5b=2")
    parser.add_argument("--warmup", default="tiny,demo", help="sizes that get a discarded warm-up run first")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_callback"))
    parser.add_argument("--report", type=Path, default=None, help="Markdown file to write the section into")
    parsed = parser.parse_args()
    steps = dict(item.split("=") for item in parsed.steps.split(","))
    repeats = dict(item.split("=") for item in parsed.repeats.split(","))
    started = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()[0]
    rows = []
    results = []
    for size in parsed.sizes.split(","):
        warmup = size in parsed.warmup.split(",")
        result = bench(size, parsed.workdir, int(steps[size]), int(repeats[size]), warmup)
        results.append(result)
        rows.append(summarise(result))
        print(json.dumps(rows[-1]), flush=True)
    finished = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    (parsed.workdir / "results.json").write_text(json.dumps({"results": results, "rows": rows}, indent=2))
    command = "python benchmarks/bench_callback.py " + " ".join(
        f"--{k} {v}" for k, v in [("sizes", parsed.sizes), ("steps", parsed.steps), ("repeats", parsed.repeats)]
    )
    text = markdown(rows, command, started, finished, (load_before, os.getloadavg()[0]))
    print(text)
    if parsed.report is not None:
        write_section(parsed.report, text)


if __name__ == "__main__":
    main()
