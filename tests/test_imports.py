"""Import hygiene: what importing a public module loads, and that importing changes no global state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

#: Modules a training script that only adds the telemetry callback must not load.
MERGE_STACK = (
    "ram_trl.engine",
    "ram_trl.planner",
    "ram_trl.streaming",
    "ram_trl.analysis",
    "ram_trl.config",
    "ram_trl.report",
    "ram_trl.lora_export",
    "ram_trl.plots",
    "matplotlib",
)


def _loaded_after(statement: str) -> set[str]:
    """Names in ``sys.modules`` after running ``statement`` in a fresh interpreter."""
    code = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(json.loads(done.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    "statement",
    [
        "import ram_trl.callbacks",
        "from ram_trl.callbacks import TaskVectorSparsityCallback",
        "from ram_trl.telemetry import TaskVectorTracker",
    ],
)
def test_telemetry_does_not_load_the_merge_stack(statement):
    loaded = _loaded_after(statement)
    assert "ram_trl.telemetry.tracker" in loaded
    assert not loaded & set(MERGE_STACK), sorted(loaded & set(MERGE_STACK))


def test_importing_the_package_loads_neither_torch_nor_the_merger():
    loaded = _loaded_after("import ram_trl")
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}
    assert sorted(m for m in loaded if m.startswith("ram_trl")) == ["ram_trl", "ram_trl.errors"]


def test_public_names_load_on_first_use():
    loaded = _loaded_after("import ram_trl\nassert callable(ram_trl.merge)")
    assert "ram_trl.engine" in loaded
    import ram_trl

    assert {"merge", "analyze", "MergeConfig"} <= set(dir(ram_trl))
    assert ram_trl.merge.__module__ == "ram_trl.engine"
    assert ram_trl.analyze.__module__ == "ram_trl.analysis"
    assert ram_trl.MergeConfig.__module__ == "ram_trl.config"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ram_trl.nothing  # noqa: B018


def test_defaults_and_sizes_import_nothing_heavy():
    loaded = _loaded_after("import ram_trl.defaults, ram_trl.sizes")
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}


def test_no_test_folder_shadows_a_standard_library_module():
    """The worker scripts in ``tests/`` (run by torchrun, DeepSpeed and accelerate as files) have ``tests/`` first on
    ``sys.path``: a folder there named like a standard-library module (``tests/statistics/``) would replace that
    module for every library the worker imports (DeepSpeed's optimizers import ``statistics``). Modules the
    interpreter loads before the script's folder is on the path (``io``) cannot be shadowed."""
    from pathlib import Path

    loaded_at_startup = _loaded_after("pass")
    tests = Path(__file__).parent
    for root in (tests, *(p for p in tests.rglob("*") if p.is_dir())):
        shadowing = sorted(
            p.name
            for p in root.iterdir()
            if (p.is_dir() or p.suffix == ".py")
            and p.stem in sys.stdlib_module_names
            and p.stem not in loaded_at_startup
        )
        assert not shadowing, (
            f"{root}: {shadowing} shadow standard-library modules for scripts run from there"
        )
