"""Read an analysis report (``analysis.json`` from ``ram-trl analyze`` or a recipe run's ``analysis/``) and say
which regime the agents are in.

    ram-trl example ex && ram-trl analyze --base ex/base ex/agent_* --out ex/analysis
    python examples/read_analysis.py ex/analysis/analysis.json

RAM's premise is sparse, heterogeneous task vectors: low density and a real share of elements only one agent changed.
Dense task vectors with almost no unique elements make RAM behave like plain averaging of the overlap.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(path: str) -> None:
    analysis = json.loads(Path(path).read_text(encoding="utf-8"))
    eps = analysis["parameters"]["eps"]
    print(f"{analysis['num_agents']} agents, {analysis['total_elements']:,} elements, eps = {eps:g}")
    for agent in analysis["agents"]:
        active = agent["active"]
        unique_share = agent["unique"] / active if active else 0.0
        rho = agent["rho"]
        regime = "sparse (RAM regime)" if agent["density"] < 0.5 and unique_share > 0.05 else "dense / overlapping"
        print(
            f"  {agent['name']:>12}: density {agent['density']:.1%}, unique {unique_share:.1%} of its active "
            f"elements, rho {rho}, RAM+ lambda {agent['lambda']['ram_plus']}: {regime}"
        )
    counts = analysis["overall"]["element_counts"]
    print("elements changed by exactly k agents (k = 0..N):", counts)
    densest = sorted(analysis["anatomy"]["modules"], key=lambda bucket: -max(bucket["density"]))[:3]
    for bucket in densest:
        print(f"  dense module type {bucket['module']}: densities {[round(d, 3) for d in bucket['density']]}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "example_out/analysis/analysis.json")
