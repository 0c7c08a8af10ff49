"""Cost of one task-vector measurement on DeepSpeed ZeRO-3 partitions (2 CPU ranks, gloo) against one process.

Builds a Qwen2-shaped base from a config (float32 on disk, cached in ``WORKDIR/base``), then measures the same
trained weights (base + 1e-3 on every 7th flat element of every tensor, defined by flat index so each rank can
perturb its own partition) twice: in one process (plain model), and on 2 ranks under ZeRO-3 (``deepspeed``
launcher), where each rank counts its partitions against the same ranges of the base on disk and only counts are
all-reduced. Reports the median ``TaskVectorTracker.measure`` wall time of ``--repeats`` measurements (after one
warm-up), the elements each rank read, the bytes all-reduced per measurement, and checks that both give the same
numbers.

Usage::

    python benchmarks/bench_telemetry_zero3.py --workdir /tmp/bench_tv_zero3 --report BENCHMARKS.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPE = dict(hidden_size=512, num_layers=8, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2)
STRIDE = 7
SECTION_START = "<!-- bench_telemetry_zero3:start -->"
SECTION_END = "<!-- bench_telemetry_zero3:end -->"


def perturb_(values: torch.Tensor, offset: int) -> None:
    """Add 1e-3 * (1 + (i % 13) / 13) to the elements whose flat index i (in the full tensor) is a multiple of STRIDE
    (varied sizes: a constant delta would make the standard deviation pure rounding noise)."""
    index = torch.arange(offset, offset + values.numel())
    delta = (index % STRIDE == 0).to(torch.float64) * 1e-3 * (1 + (index % 13) / 13)
    values.add_(delta.to(values.dtype))


def timed_measurements(tracker, model, repeats: int) -> tuple[dict[str, float], list[float]]:
    tracker.measure(model, 0)
    times = []
    for step in range(repeats):
        started = time.perf_counter()
        metrics = tracker.measure(model, step + 1)
        times.append(time.perf_counter() - started)
    return metrics, times


def single(base: Path, repeats: int) -> dict:
    from transformers import AutoModelForCausalLM

    from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker

    torch.set_num_threads(1)  # as each ZeRO-3 rank (OMP_NUM_THREADS=1): the same work per core
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            perturb_(param.view(-1), 0)
    tracker = TaskVectorTracker(base_model=base, save_dtype="float32", magnitudes=True)
    metrics, times = timed_measurements(tracker, model, repeats)
    numel = sum(p.numel() for p in model.parameters())
    return {"metrics": metrics, "times": times, "local_elements": numel}


def rank_main(base: Path, out: Path, repeats: int) -> None:
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from ram_trl.callbacks.telemetry.shards import iter_local_shards
    from ram_trl.callbacks.telemetry.tracker import TaskVectorTracker

    deepspeed.init_distributed(dist_backend="gloo")
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}
    keep = HfDeepSpeedConfig(config)  # noqa: F841 - while alive, from_pretrained loads straight into partitions
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    with torch.no_grad():
        for shard in iter_local_shards(engine):
            perturb_(shard.values, shard.offset)
    calls = {"all_reduce": 0, "bytes": 0}
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls["all_reduce"] += 1
        calls["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    tracker = TaskVectorTracker(base_model=base, save_dtype="float32", magnitudes=True)
    tracker.setup(engine)
    dist.all_reduce = counting
    metrics, times = timed_measurements(tracker, engine, repeats)
    dist.all_reduce = real
    local = sum(s.numel for s in iter_local_shards(engine))
    result = {
        "metrics": metrics,
        "times": times,
        "local_elements": local,
        "all_reduce_per_measure": calls["all_reduce"] / (repeats + 1),
        "bytes_per_measure": calls["bytes"] / (repeats + 1),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.barrier()


def report(path: Path, text: str) -> None:
    old = path.read_text() if path.exists() else ""
    section = f"{SECTION_START}\n{text}\n{SECTION_END}"
    if SECTION_START in old:
        head, rest = old.split(SECTION_START, 1)
        new = head + section + rest.split(SECTION_END, 1)[1]
    else:
        new = old.rstrip() + "\n\n" + section + "\n"
    path.write_text(new)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_tv_zero3"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--rank-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    base = args.workdir / "base"
    if args.rank_worker:
        from ram_trl.distributed import exit_distributed

        rank_main(base, args.workdir, args.repeats)
        exit_distributed()  # the gloo groups DeepSpeed holds outlive the script: exit without finalizing
    if not (base / "model.safetensors").is_file():
        from ram_trl.synthetic import make_base_checkpoint

        make_base_checkpoint(base, dtype=torch.float32, **SHAPE)
    one = single(base, args.repeats)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port", "29677"]
    command += [str(Path(__file__).resolve()), "--rank-worker", "--workdir", str(args.workdir)]
    command += ["--repeats", str(args.repeats)]
    try:
        subprocess.run(command, check=True, env=env, capture_output=True)
    finally:  # DeepSpeed's CPU all-reduce never unlinks its shared-memory buffers (67 MB per rank)
        for buffer in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_29677_*"):
            buffer.unlink(missing_ok=True)
    ranks = [json.loads((args.workdir / f"rank{r}.json").read_text()) for r in range(2)]
    skip = ("measure_seconds", "state_mb", "work_mb")
    same = all(agrees(r["metrics"][k], v, k) for r in ranks for k, v in one["metrics"].items() if not k.endswith(skip))
    numel = one["local_elements"]
    lines = [
        "## Telemetry on DeepSpeed ZeRO-3 partitions (bench_telemetry_zero3.py)",
        "",
        f"Qwen2 shape {SHAPE}, {numel / 1e6:.1f}M parameters, float32; one `TaskVectorTracker.measure` (magnitudes "
        f"on, base on disk through memory maps), median of {args.repeats} after a warm-up, 1 torch thread per process "
        "(2 ranks on 2 cores). Figures from a shared machine (other jobs running): compare the rows, not the "
        "absolute times.",
        "",
        "| run | elements read per rank | median measure (s) | all-reduces / bytes per measurement |",
        "|---|---|---|---|",
        f"| 1 process | {numel:,} | {statistics.median(one['times']):.3f} | - |",
    ]
    for r, rank in enumerate(ranks):
        lines.append(
            f"| ZeRO-3 rank {r} of 2 | {rank['local_elements']:,} | {statistics.median(rank['times']):.3f} | "
            f"{rank['all_reduce_per_measure']:.0f} / {rank['bytes_per_measure']:,.0f} |"
        )
    lines += [
        "",
        f"Same metrics on both ranks as in one process: {'yes' if same else 'NO'}. Each rank reads 1/2 of the "
        "elements and all-reduces a fixed ~1 MB (the magnitude histogram) whatever the model's size; the wall "
        "time per rank is not halved here because the two ranks share the 2 cores with each other and with other "
        "jobs.",
    ]
    text = "\n".join(lines)
    print(text)
    if args.report is not None:
        report(args.report, text)


def agrees(got: float, want: float, key: str) -> bool:
    """Counts are exact; magnitude moments are float64 sums added in another order."""
    if "/magnitude/" in key:
        return abs(got - want) <= 1e-9 * max(1.0, abs(want))
    return got == want


if __name__ == "__main__":
    main()
