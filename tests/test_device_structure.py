"""Structural check: the measurement and merge modules create tensors on a stated device.

A tensor factory (``torch.zeros``, ``torch.tensor``, ``torch.arange`` ...) without ``device=`` allocates on the host;
in code that also runs on an accelerator that is either a bug (a host operand meeting device values: the class of
the GPU issue) or a decision, which the line then states with a ``# host`` comment. ``*_like`` factories take their
input's device and are always fine.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "ram_trl"
MODULES = sorted(
    [
        *ROOT.glob("callbacks/telemetry/*.py"),
        *ROOT.glob("statistics/*.py"),
        *ROOT.glob("methods/*.py"),
        *ROOT.glob("callbacks/preview/*.py"),
        *ROOT.glob("merging/passes/*.py"),
        *(ROOT / "merging" / name for name in ("engine.py", "range_merge.py", "streaming.py")),
        *(ROOT / "merging" / "lora" / name for name in ("svd.py", "export.py")),
        ROOT / "evaluation" / "fisher.py",
    ]
)
FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "tensor",
    "as_tensor",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "eye",
}


def undeclared_host_factories(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of every ``torch.<factory>(...)`` call without ``device=`` and without ``# host`` on one of
    its lines.

    Args:
        source: Python source text.

    Returns:
        The offending calls.
    """
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in FACTORIES or not (
            isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
        ):
            continue
        if any(k.arg == "device" for k in node.keywords):
            continue
        if any("# host" in line for line in lines[node.lineno - 1 : node.end_lineno]):
            continue
        found.append((node.lineno, lines[node.lineno - 1].strip()))
    return found


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_tensor_factories_state_their_device(path):
    found = undeclared_host_factories(path.read_text())
    assert not found, (
        f"{path.relative_to(ROOT.parent)}: tensor factories without device= (pass the device of the values they "
        "meet, or mark the line `# host` when the host is the design):\n"
        + "\n".join(f"  line {n}: {text}" for n, text in found)
    )


def test_the_check_catches_an_undeclared_factory():
    bad = "import torch\n\ndef f(x):\n    return torch.arange(x.numel()) * x\n"
    good = "import torch\n\ndef f(x):\n    return torch.arange(x.numel(), device=x.device) * x\n"
    declared = "import torch\n\nCODES = torch.arange(\n    8,\n)  # host\n"
    assert undeclared_host_factories(bad) == [(4, "return torch.arange(x.numel()) * x")]
    assert undeclared_host_factories(good) == [] and undeclared_host_factories(declared) == []
