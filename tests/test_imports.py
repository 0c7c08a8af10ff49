"""Import hygiene: what importing a public module loads, that importing changes no global state, the package's
import graph; and the test tree's layout (it mirrors the package, test modules never import each other)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

#: Modules a training script that only adds the telemetry callback must not load.
MERGE_STACK = (
    "ram_trl.merging.engine",
    "ram_trl.merging.planner",
    "ram_trl.merging.streaming",
    "ram_trl.analysis",
    "ram_trl.merging.config",
    "ram_trl.merging.report",
    "ram_trl.merging.lora.export",
    "ram_trl.analysis.plots",
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
        "from ram_trl.callbacks.telemetry import TaskVectorTracker",
    ],
)
def test_telemetry_does_not_load_the_merge_stack(statement):
    loaded = _loaded_after(statement)
    assert "ram_trl.callbacks.telemetry.tracker" in loaded
    assert not loaded & set(MERGE_STACK), sorted(loaded & set(MERGE_STACK))


def test_importing_the_package_loads_neither_torch_nor_the_merger():
    loaded = _loaded_after("import ram_trl")
    assert not {m for m in loaded if m == "torch" or m.startswith("torch.")}
    assert sorted(m for m in loaded if m.startswith("ram_trl")) == ["ram_trl", "ram_trl.errors", "ram_trl.lazy"]


def test_public_names_load_on_first_use():
    loaded = _loaded_after("import ram_trl\nassert callable(ram_trl.merge)")
    assert "ram_trl.merging.engine" in loaded
    import ram_trl

    assert {"merge", "analyze", "MergeConfig"} <= set(dir(ram_trl))
    assert ram_trl.merge.__module__ == "ram_trl.merging.engine"
    assert ram_trl.analyze.__module__ == "ram_trl.analysis"
    assert ram_trl.MergeConfig.__module__ == "ram_trl.merging.config.schema"
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        ram_trl.nothing  # noqa: B018


@pytest.mark.parametrize(
    "module",
    ["ram_trl.callbacks", "ram_trl.merging.engine", "ram_trl.analysis", "ram_trl.cli", "ram_trl.recipes.runner"],
)
def test_importing_changes_no_global_state(module):
    """Importing a module leaves the garbage collector (on, thresholds, nothing frozen) and torch's thread count as
    they were; only the command line, when it runs, tunes them (tests/test_runtime.py)."""
    state = "[gc.isenabled(), gc.get_threshold(), gc.get_freeze_count(), torch.get_num_threads()]"
    code = f"import gc, json, torch\nbefore = {state}\nimport {module}\nprint(json.dumps([before, {state}]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = json.loads(done.stdout.splitlines()[-1])
    assert after == before


WITHOUT_CLI_PACKAGES = """
import sys
for name in ("rich", "matplotlib"):
    sys.modules[name] = None  # as if not installed: importing them raises ImportError
from pathlib import Path
import ram_trl
from ram_trl.callbacks import MergePreviewCallback, TaskVectorSparsityCallback
from ram_trl.cli import main
from ram_trl.synthetic import make_agent_set, make_base_checkpoint

root = Path(sys.argv[1])
base = make_base_checkpoint(root / "base", hidden_size=8, num_layers=1, intermediate_size=16)
TaskVectorSparsityCallback(base_model=base)
agents = make_agent_set(base, root / "agents", (0.1, 0.2))
config = {"merge_method": "ram_plus", "base_model": str(base), "models": [{"model": str(a)} for a in agents]}
ram_trl.merge(config, root / "merged", progress=False)
print("exit", main(["merge", "x.yaml", str(root / "cli")]))
"""


def test_the_library_and_the_callbacks_need_neither_rich_nor_matplotlib(tmp_path):
    """rich and matplotlib are the command line's (the ``cli`` extra): the callbacks import and a library merge runs
    without them; the command line refuses to start, naming the extra."""
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_CLI_PACKAGES, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert done.stdout.splitlines()[-1] == "exit 2"
    assert "ram-trl merge: error: the command line needs rich and matplotlib (pip install 'ram-trl[cli]')" in (
        done.stderr
    )
    assert (tmp_path / "merged" / "model.safetensors").is_file()


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
        assert not shadowing, f"{root}: {shadowing} shadow standard-library modules for scripts run from there"


# ---------------------------------------------------------------------------------------------------------------
# The import graph of the package: acyclic, counting imports inside functions; no private names across modules

PACKAGE = Path(__file__).resolve().parents[1] / "ram_trl"


def _module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__.py``)."""
    files = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        files[".".join(parts)] = path
    return files


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: set[str], type_only: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at any depth (functions included); those under ``TYPE_CHECKING`` only
    with ``type_only``."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child) and not type_only:
                for other in child.orelse:
                    visit_statement(other)
                continue
            visit_statement(child)

    def visit_statement(child: ast.AST) -> None:
        if isinstance(child, ast.Import | ast.ImportFrom):
            found.append(child)
        else:
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return found


def _absolute(name: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _owner(target: str, modules: set[str]) -> str | None:
    """The package module ``target`` names (a module, or a name inside one); ``None`` outside the package."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def _import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import submodule`` counts as the submodule); imports
    under ``TYPE_CHECKING`` count with ``type_only``."""
    files = _module_files()
    modules = set(files)
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        edges: set[str] = set()
        for node in _imports(name, path, modules, type_only):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                source = _absolute(name, path, node)
                targets = [
                    f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names
                ]
            for target in targets:
                owner = _owner(target, modules)
                # every module imports the package root implicitly; it only holds the exceptions and the lazy names
                if owner is not None and owner not in (name, "ram_trl"):
                    edges.add(owner)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                on_stack.discard(other)
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_finds_known_edges():
    graph = _import_graph()
    assert "ram_trl.merging.passes.merge" in graph["ram_trl.merging.engine"]
    assert "ram_trl.merging.context" in graph["ram_trl.merging.passes.statistics"]
    assert "ram_trl.merging.engine" in graph["ram_trl.cli"]  # an import inside a function counts
    assert "ram_trl.merging.context" not in graph["ram_trl.merging.report"]  # one under TYPE_CHECKING does not
    assert "ram_trl.merging.context" in _import_graph(type_only=True)["ram_trl.merging.report"]  # unless asked
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_package_has_no_import_cycles():
    """No module imports (directly or through others) one that imports it back, not even from inside a function or
    for type hints only: a cycle kept alive by a deferred or a ``TYPE_CHECKING`` import is still a cycle."""
    cycles = _cycles(_import_graph(type_only=True))
    assert cycles == [], cycles


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The package modules ``start`` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for other in graph[todo.pop()] - seen:
            seen.add(other)
            todo.append(other)
    return seen


#: The modules of single merge methods (the engine reaches them only through the registry).
METHOD_MODULES = {
    f"ram_trl.methods.{name}"
    for name in ("breadcrumbs", "dare", "della", "fisher", "linear", "model_stock", "ram", "slerp", "ties")
}


def test_layers_point_one_way():
    """The counting maths lies below the statistics and the methods: the statistics reach no method; the engine
    and its passes name no method (they reach them through the registry)."""
    graph = _import_graph()
    for module in ("ram_trl.statistics.counting", "ram_trl.statistics.overlap", "ram_trl.statistics.magnitude"):
        reached = {m for m in _reachable(graph, module) if m.startswith("ram_trl.methods")}
        assert not reached, (module, sorted(reached))
    passes = [m for m in graph if m == "ram_trl.merging.passes" or m.startswith("ram_trl.merging.passes.")]
    assert len(passes) > 1, passes
    for module in (*passes, "ram_trl.merging.engine"):
        assert not graph[module] & METHOD_MODULES, (module, sorted(graph[module] & METHOD_MODULES))


def test_the_preview_and_the_evaluation_reach_no_recipe_module():
    """The merge preview scores through the evaluation the recipes also use (``ram_trl.evaluation``), which lies
    below both: neither reaches ``ram_trl.recipes`` (which imports the preview for a stage's ``preview:``)."""
    graph = _import_graph()
    assert "ram_trl.callbacks.preview" in _reachable(graph, "ram_trl.recipes.stage")
    assert "ram_trl.evaluation.scoring" in _reachable(graph, "ram_trl.callbacks.preview")
    preview = [m for m in graph if m == "ram_trl.callbacks.preview" or m.startswith("ram_trl.callbacks.preview.")]
    evaluation = [m for m in graph if m == "ram_trl.evaluation" or m.startswith("ram_trl.evaluation.")]
    for module in preview + evaluation:
        reached = {m for m in _reachable(graph, module) if m == "ram_trl.recipes" or m.startswith("ram_trl.recipes.")}
        assert not reached, (module, sorted(reached))


def test_no_private_names_across_modules():
    """A module uses only the public names of the package's other modules (no ``from ram_trl.x import _y``, no
    ``module._y``)."""
    files = _module_files()
    modules = set(files)
    found = []
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        aliases: set[str] = set()
        for node in _imports(name, path, modules):
            if isinstance(node, ast.Import):
                aliases.update(alias.asname for alias in node.names if alias.asname and alias.name in modules)
                continue
            source = _absolute(name, path, node)
            if _owner(source, modules) is None:
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    aliases.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{name}: from {source} import {alias.name}")
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                found.append(f"{name}: {node.value.id}.{node.attr}")
    assert found == [], found


# ---------------------------------------------------------------------------------------------------------------
# The test tree: it mirrors the package (docs/development.md), and test modules never import from each other

TESTS = Path(__file__).resolve().parent

#: Modules whose tests do not sit at the mirrored path, and where they are (docs/development.md, "Tests").
MIRROR_EXCEPTIONS = {
    "ram_trl/statistics/overlap.py": "test_statistics_overlap.py",
    "ram_trl/statistics/magnitude.py": "test_statistics_magnitude.py",
    "ram_trl/statistics/counting.py": "test_statistics_counting.py",
    "ram_trl/statistics/anatomy.py": "test_statistics_anatomy.py",
    "ram_trl/statistics/effect.py": "test_statistics_effect.py",
    "ram_trl/merging/engine.py": "merging/test_engine_golden.py",
    # the configuration is tested through its resolution, as a whole
    **{
        f"ram_trl/merging/config/{name}.py": "merging/test_config.py"
        for name in ("schema", "settings", "slices", "tokens", "resolve")
    },
    "ram_trl/recipes/stage.py": "recipes/test_runner.py",
    # checks tested through the commands that run them
    "ram_trl/io/chat_template.py": "merging/test_config.py",
    "ram_trl/io/gguf_check.py": "io/test_gguf.py",
    "ram_trl/recipes/code_digest.py": "recipes/test_reuse.py",
    # rooms split out of a whole, tested through it
    "ram_trl/callbacks/preview/config.py": "callbacks/preview/test_callback.py",
    "ram_trl/callbacks/telemetry/metrics.py": "callbacks/telemetry/test_tracker.py",
    **{f"ram_trl/{name}.py": "test_output.py" for name in ("fs", "output_errors", "temp_siblings")},
}


def test_every_module_has_its_test_file():
    missing, needless = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name in ("__init__.py", "__main__.py"):
            continue
        module = path.relative_to(PACKAGE.parent).as_posix()
        mirrored = path.relative_to(PACKAGE).with_name(f"test_{path.name}").as_posix()
        if module in MIRROR_EXCEPTIONS and (TESTS / mirrored).is_file():
            needless.append(module)
        expected = MIRROR_EXCEPTIONS.get(module, mirrored)
        if not (TESTS / expected).is_file():
            missing.append(f"{module}: no tests/{expected}")
    assert missing == [], missing
    assert needless == [], f"these modules now have mirrored test files: drop them from MIRROR_EXCEPTIONS: {needless}"


def test_test_modules_do_not_import_each_other():
    """Shared test code lives in modules without tests (``tests/helpers.py``, ``conftest.py``, ...), never in a
    ``test_*.py`` that another module imports."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            imported = [n for n in names if n.startswith("tests.") and n.rpartition(".")[2].startswith("test_")]
            found += [f"{path.relative_to(TESTS)}: {name}" for name in imported]
    assert found == [], found
