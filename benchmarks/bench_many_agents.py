"""The cost of N agents (issue 34).

Statistics: one 20,000-element chunk of N agents' activity masks (density 0.3), counted by
:meth:`ram_trl.statistics.overlap.OverlapStatistics.update` (the path for more than 12 agents).
Whole merge (``--merge``): ``ram_trl.merge`` of N entries of 0.7 MB float32 agents (8 distinct agents, 10% of the
elements changed, repeated in turn: merging many checkpoints of one run) with each ``--methods``.

    python benchmarks/bench_many_agents.py [--agents 100 400 2000] [--elements 20000]
    python benchmarks/bench_many_agents.py --merge [--agents 100 400 2000] [--methods task_arithmetic ram]

Prints one markdown row per N (and method): seconds, and checksums (equal across versions).
"""

from __future__ import annotations

import argparse
import hashlib
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from ram_trl.statistics.overlap import OverlapStatistics

SHAPES = {"embed.weight": (1000, 64), "up.weight": (256, 64), "down.weight": (64, 256), "head.weight": (1000, 64)}


def write_inputs(root: Path, distinct: int = 8) -> tuple[Path, list[Path]]:
    """A 0.7 MB float32 base and ``distinct`` agents, each changing 10% of its elements."""
    generator = torch.Generator().manual_seed(0)
    base = {n: torch.randn(s, generator=generator) for n, s in SHAPES.items()}
    paths = []
    for i, name in enumerate(["base", *(f"agent{t}" for t in range(distinct))]):
        tensors = dict(base)
        if i:
            tensors = {
                n: t
                + (torch.rand(t.shape, generator=generator) < 0.1) * 0.01 * torch.randn(t.shape, generator=generator)
                for n, t in base.items()
            }
        (root / name).mkdir()
        save_file(tensors, str(root / name / "model.safetensors"))
        paths.append(root / name)
    return paths[0], paths[1:]


def whole_merges(agents: list[int], methods: list[str]) -> None:
    import ram_trl

    print("| entries | method | seconds (wall) | seconds (CPU, all threads) | output sha256 |\n|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        base, distinct = write_inputs(Path(tmp))
        for n_agents in agents:
            for method in methods:
                config = {
                    "merge_method": method,
                    "base_model": str(base),
                    "models": [{"model": str(distinct[t % len(distinct)])} for t in range(n_agents)],
                }
                out = Path(tmp) / f"out_{method}_{n_agents}"
                start, cpu = time.perf_counter(), time.process_time()
                ram_trl.merge(config, out, progress=False)
                seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
                digest = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()[:16]
                print(f"| {n_agents} | {method} | {seconds:.1f} | {cpu:.1f} | {digest} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[100, 400, 2000])
    parser.add_argument("--elements", type=int, default=20_000)
    parser.add_argument("--merge", action="store_true", help="time whole merges instead of the statistics")
    parser.add_argument("--methods", nargs="+", default=["task_arithmetic", "ram"])
    args = parser.parse_args()
    if args.merge:
        whole_merges(args.agents, args.methods)
        return
    torch.set_num_threads(1)
    print("| agents | seconds | histogram total | pairwise total |\n|---|---|---|---|")
    for n_agents in args.agents:
        mask = torch.rand(n_agents, args.elements, generator=torch.Generator().manual_seed(0)) < 0.3
        start = time.perf_counter()
        stats = OverlapStatistics.zeros(n_agents)
        stats.update(mask)
        seconds = time.perf_counter() - start
        print(f"| {n_agents} | {seconds:.2f} | {int(stats.histogram.sum())} | {int(stats.pairwise.sum())} |")


if __name__ == "__main__":
    main()
