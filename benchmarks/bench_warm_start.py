"""The demo's warm start, timed: wall and CPU seconds, steps, losses and acceptance of one warm start on the demo's rows
and base (``ram-trl demo``'s ``RUN/base_init`` and ``RUN/data``), in this process, on ``--threads`` threads.

    python benchmarks/bench_warm_start.py --prepare /tmp/wsb              # draw the demo's rows, build its base (once)
    python benchmarks/bench_warm_start.py --run /tmp/wsb --steps 100      # phase one only, 100 steps, no checks
    python benchmarks/bench_warm_start.py --run /tmp/wsb                  # the demo's whole warm start (acceptance)
    python benchmarks/bench_warm_start.py --run /tmp/wsb --module OLD.py  # another implementation of warm_start.py

``--module`` compares against another revision of the module, e.g.
``git show REV:ram_trl/recipes/warm_start.py > /tmp/old.py``. Run the variants one after the other, each in its own
process, under the same load. Prints one JSON line; each check (and, where the implementation reports them, the
steps between checks) is a line on stderr as it happens.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path


def _run(directory: Path):
    from ram_trl.recipes import DEMO_RECIPE
    from ram_trl.recipes.runner import Run, RunOptions
    from ram_trl.recipes.schema import load_recipe

    recipe, root = load_recipe(DEMO_RECIPE)
    return Run(recipe, root, directory, RunOptions(progress=False, figures=False))


def prepare(directory: Path) -> None:
    run = _run(directory)
    run.preparation.warm_start = lambda: None  # everything the warm start reads, not the warm start
    run.preparation.prepare()


def measure(directory: Path, steps: int | None, module: Path | None, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from ram_trl.recipes.data import read_jsonl
    from ram_trl.recipes.tasks import mixture

    if module is None:
        from ram_trl.recipes import warm_start as implementation
    else:
        found = importlib.util.spec_from_file_location("warm_start_under_test", module)
        implementation = importlib.util.module_from_spec(found)
        found.loader.exec_module(implementation)
    run = _run(directory)
    preparation, layout = run.preparation, run.layout
    spec = layout.recipe.warm_start
    spec = spec.model_copy(update={"abstain_reply": preparation.abstain_reply(spec.abstain_reply)})
    checks = layout.check_tasks()
    if steps is not None:  # phase one only, a fixed number of steps: the training loop alone
        spec = spec.model_copy(update={"steps": steps, "abstain_share": 0.0, "accept": None})
        checks = None
    rows = mixture([read_jsonl(file) for file in preparation._warm_files()], seed=spec.seed)
    out = directory / f"bench_base_{os.getpid()}"

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    lines = {"write": say} if "write" in inspect.signature(implementation.warm_start).parameters else {}
    cpu, wall = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    record = implementation.warm_start(
        layout.initial_base,
        out,
        rows,
        spec,
        progress=False,
        checks=checks,
        on_check=lambda phase, step, values: say(f"check ({phase}) step {step}: {values}"),
        **lines,
    )
    wall, after = time.perf_counter() - wall, resource.getrusage(resource.RUSAGE_SELF)
    return {
        "implementation": str(module or "package"),
        "threads": threads,
        "wall_s": round(wall, 1),
        "cpu_s": round(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime, 1),
        "steps": record["steps"],
        "loss_first": round(record["loss_first"], 4),
        "loss_last": round(record["loss_last"], 4),
        "acceptance": record.get("acceptance"),
        "output": str(out),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prepare", type=Path, help="draw the demo's rows and build its base into this directory")
    parser.add_argument("--run", type=Path, help="a directory made by --prepare")
    parser.add_argument("--steps", type=int, help="phase one only, this many steps, no acceptance checks")
    parser.add_argument("--module", type=Path, help="a warm_start.py to measure instead of the package's")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.prepare is not None:
        prepare(args.prepare)
    elif args.run is not None:
        print(json.dumps(measure(args.run, args.steps, args.module, args.threads)))
    else:
        parser.error("give --prepare DIR or --run DIR")


if __name__ == "__main__":
    sys.exit(main())
