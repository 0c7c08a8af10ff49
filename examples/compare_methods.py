"""Merge the same agents with every method and print what each did to the agents' unique elements.

Run from the repository root after `ram-trl example example_out`:

    python examples/compare_methods.py example_out
"""

from __future__ import annotations

import sys
from pathlib import Path

import ram_trl

METHODS = {
    "ram": {},
    "ram_plus": {"r": 0.1, "alpha": 2.0},
    "ram_plus_soft": {"r": 0.1},
    "task_arithmetic": {"lambda": 1 / 3},
    "ties": {"lambda": 1.0},
    "dare_linear": {"lambda": 1 / 3},
}


def main(root: str) -> None:
    root_path = Path(root)
    agents = sorted(p for p in root_path.glob("agent_*") if p.is_dir())
    for method, params in METHODS.items():
        agent_params = {"density": 0.3} if method in ("ties", "dare_linear") else {}
        config = {
            "merge_method": method,
            "base_model": str(root_path / "base"),
            "models": [{"model": str(a), "parameters": agent_params} for a in agents],
            "parameters": params,
        }
        report = ram_trl.merge(config, root_path / "merged" / method, overwrite=True, progress=False)
        lambdas = ", ".join("-" if a["lambda"] is None else f"{a['lambda']:.3f}" for a in report["agents"])
        print(f"{method:16s} lambda_t: {lambdas}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "example_out")
