"""One command for a GPU machine: does everything run on CUDA, byte-identical to the CPU, and how fast.

    python benchmarks/gpu_check.py            # on a machine with CUDA: ~1B-param merges, the 0.5B telemetry model
    python benchmarks/gpu_check.py --smoke    # the same code paths on the CPU at tiny sizes (< 1 min; CI runs it)

Prints one table (and writes it as JSON with ``--json PATH``):

- ``telemetry``: a Qwen2-shaped model (Qwen2.5-0.5B's shapes; tiny with ``--smoke``) in bf16 on the device, its base
  on disk; a training-step proxy (forward, backward, AdamW step) with a measurement every ``--interval`` steps:
  measure seconds, overhead (measure seconds / interval / step seconds), density, and where the base lives;
- ``merge <method>``: ``ram_trl.merge`` of 3 agents on the device against the CPU merge (byte-identical or not),
  and the read floor (read every input once, move it to the device, upcast to float32);
- ``mergekit --cuda``: when mergekit is installed, its ``ram`` merge of the same inputs;

Rows that need a package the machine lacks say so instead of a number.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import ram_trl  # noqa: E402
from ram_trl.parallel import plan_threads  # noqa: E402
from ram_trl.synthetic import make_agent_set, make_base_checkpoint  # noqa: E402
from ram_trl.telemetry import TaskVectorTracker  # noqa: E402

#: Qwen2.5-0.5B's shapes (telemetry) and a ~1B-param model (merges); tiny ones for --smoke
SHAPES = {
    "telemetry": dict(hidden_size=896, num_layers=24, intermediate_size=4864, num_attention_heads=14,
                      num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "merge": dict(hidden_size=2048, num_layers=16, intermediate_size=5632, num_attention_heads=16,
                  num_key_value_heads=4, vocab_size=32000),
    "smoke": dict(hidden_size=64, num_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2),
}  # fmt: skip


def _median_seconds(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def telemetry_row(root: Path, device: torch.device, smoke: bool, interval: int, steps: int) -> dict[str, Any]:
    """The training-step proxy with a measurement every ``interval`` steps."""
    from transformers import AutoModelForCausalLM

    base = make_base_checkpoint(root / "telemetry_base", **SHAPES["smoke" if smoke else "telemetry"])
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16).to(device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)  # updates above one bf16 step of many weights
    tracker = TaskVectorTracker(base_model=base)
    tracker.setup(model)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), device=device)

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)

    step()  # warm-up
    step_seconds = _median_seconds(step, steps)
    measured = [tracker.measure(model) for _ in range(3)]
    measure_seconds = statistics.median(m["task_vector/measure_seconds"] for m in measured)
    return {
        "row": "telemetry (train-step proxy, bf16)",
        "params": sum(p.numel() for p in model.parameters()),
        "step_s": round(step_seconds, 4),
        "measure_s": round(measure_seconds, 4),
        "overhead_pct": round(100 * measure_seconds / (interval * step_seconds), 2),
        "density": measured[-1]["task_vector/density"],
        "base": tracker.base_description,
    }


def read_floor(paths: list[Path], device: torch.device) -> None:
    """Read every tensor of every input once, move it to ``device`` and upcast it to float32."""
    for path in paths:
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), "pt") as reader:
                for name in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensor = reader.get_tensor(name)
                    if tensor.is_floating_point():
                        tensor.to(device).float()
    _sync(device)


def merge_rows(root: Path, device: torch.device, smoke: bool, repeats: int) -> list[dict[str, Any]]:
    base = make_base_checkpoint(root / "merge_base", **SHAPES["smoke" if smoke else "merge"])
    agents = make_agent_set(base, root / "agents", densities=(0.05, 0.2, 0.4), seed=3)
    floor = _median_seconds(lambda: read_floor([base, *agents], device), repeats)
    rows = []
    for method in ("ram_plus", "ties"):
        config = {
            "merge_method": method,
            "base_model": str(base),
            "models": [{"model": str(a)} for a in agents],
        }
        if method == "ties":
            config["parameters"] = {"density": 0.2}
        outputs: dict[str, Path] = {}
        seconds: dict[str, float] = {}
        for where in ("cpu", device.type):
            if where in seconds:
                continue
            out = root / f"{method}_{where}"

            def run(where: str = where, out: Path = out, config: dict = config) -> None:
                with contextlib.redirect_stdout(io.StringIO()):  # the merge's own report table
                    ram_trl.merge(config, out, overwrite=True, device=where, progress=False)

            seconds[where] = _median_seconds(run, repeats)
            outputs[where] = out
        identical = all(
            (outputs["cpu"] / f.name).read_bytes() == f.read_bytes()
            for f in outputs[device.type].glob("*.safetensors")
        )
        rows.append(
            {
                "row": f"merge {method} --device {device.type}",
                "seconds": round(seconds[device.type], 3),
                "cpu_seconds": round(seconds["cpu"], 3),
                "read_floor_s": round(floor, 3),
                "x_floor": round(seconds[device.type] / floor, 2),
                "byte_identical_to_cpu": identical,
            }
        )
    try:
        import mergekit  # noqa: F401
    except ImportError:
        rows.append({"row": "mergekit --cuda ram", "seconds": "not installed"})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on the CPU (the code paths, no figures)"
    )
    parser.add_argument("--interval", type=int, default=5, help="steps between measurements (default 5)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        print("no CUDA device: run with --smoke for the CPU code paths", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    repeats = 1 if args.smoke else args.repeats
    with tempfile.TemporaryDirectory(prefix="ram_trl_gpu_check_") as tmp:
        root = Path(tmp)
        rows = [telemetry_row(root, device, args.smoke, args.interval, 2 if args.smoke else 5)]
        rows += merge_rows(root, device, args.smoke, repeats)
    plan = plan_threads()
    machine = torch.cuda.get_device_name() if cuda else "CPU only (smoke)"
    print(f"# gpu_check on {machine}; {plan.cores} cores (thread plan: {plan}); torch {torch.__version__}")
    for row in rows:
        print(" | ".join(f"{k}={v}" for k, v in row.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    failed = [r["row"] for r in rows if r.get("byte_identical_to_cpu") is False]
    if failed:
        print(f"NOT byte-identical to the CPU merge: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
