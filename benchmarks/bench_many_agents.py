"""The overlap statistics' cost in the number of agents (issue 34): one 20,000-element chunk of N agents' activity
masks (density 0.3), counted by :meth:`ram_trl.statistics.overlap.OverlapStatistics.update` (the path for more than
12 agents: one bincount for the histogram, one matrix product for the pairwise counts).

    python benchmarks/bench_many_agents.py [--agents 100 400 2000] [--elements 20000]

Prints one markdown row per N: seconds, and the checksums of the counts (equal across versions).
"""

from __future__ import annotations

import argparse
import time

import torch

from ram_trl.statistics.overlap import OverlapStatistics


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--agents", type=int, nargs="+", default=[100, 400, 2000])
    parser.add_argument("--elements", type=int, default=20_000)
    args = parser.parse_args()
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
