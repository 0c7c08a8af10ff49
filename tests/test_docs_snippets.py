"""Every fenced python / bash / yaml snippet of README.md and docs/ as pasted: checked, then run at tiny sizes.

Checked: YAML parses and validates against the schema it is written for (merge config, recipe), Python compiles, its
``ram_trl`` imports exist and its TRL configs name real fields (with ``bf16`` said explicitly: TRL's configs default it
on, which a CPU refuses), bash is valid and every ``ram-trl`` command line parses.

Run: each Python snippet (a fresh interpreter) and each bash line (bash, the installed ``ram-trl``), in a fresh
directory holding tiny models built from a config under the names the docs use (``SUBSTITUTE`` maps the Hub ids and
paths the docs name to them, and the sample and token counts to tiny ones), ``FILES`` (with the user's reward
functions, ``my_pkg.rewards``), the stages a snippet's ``prior_stages=[...]`` names, and the files the page's earlier
YAML snippets name on their first line (``# merge.yaml: ...``). The TRL training snippets train for real (GRPOTrainer
on the CPU, 8-token completions). A snippet whose first line is ``# the end of the script above, from its LINE:`` runs
after the page's previous Python snippet up to LINE; one whose first line is ``# ram_trl/PATH.py: at the end`` is
appended to that file in a copy of the package (holding the page's earlier ``# ram_trl/PATH.py`` files, imported
beside the others), which is then imported. A bash line matching ``LINES_NOT_RUN`` is not run (each pattern says
why); a Python snippet that cannot run as pasted says why on the line before its fence, visibly:
``_Not run by the docs test: REASON._``"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.callbacks.telemetry.helpers import write_stage

#: Imports TRL, parses every command line and trains 4 tiny GRPO runs (about 30 CPU-seconds each).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```(python|bash|yaml)\n(.*?)^```", re.S | re.M)
_NOT_RUN = re.compile(r"^_Not run by the docs test: (?P<reason>\S.*?)\._\s*$")


def _snippets() -> list[tuple[str, str, str, str | None]]:
    """``(page:line, kind, code, why it is not run or None)`` of every snippet."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in _FENCE.finditer(text):
            before = _NOT_RUN.search(text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1])
            line = text[: match.start()].count("\n") + 1
            where = f"{page.relative_to(REPO)}:{line}"
            found.append((where, match.group(1), match.group(2), before.group("reason") if before else None))
    return found


SNIPPETS = _snippets()


def test_snippets_are_found():
    kinds = {kind for _, kind, _, _ in SNIPPETS}
    assert kinds == {"python", "bash", "yaml"} and len(SNIPPETS) >= 20


def _check_python(code: str) -> None:
    tree = ast.parse(code)
    classes = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("ram_trl", "trl"):
            if node.module.split(".")[0] == "trl":
                pytest.importorskip("trl")
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
                classes[alias.asname or alias.name] = getattr(module, alias.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id.endswith("Config"):
            cls = classes.get(node.func.id)
            if cls is None or not dataclasses.is_dataclass(cls):
                continue
            fields = {f.name for f in dataclasses.fields(cls)}
            given = {k.arg for k in node.keywords if k.arg}
            assert given <= fields, f"{node.func.id} has no field {sorted(given - fields)}"
            if "bf16" in fields:  # TRL's configs default bf16 on; transformers refuses it on a CPU
                assert "bf16" in given, f"{node.func.id}(...) must say bf16 (bf16=False on a CPU)"


def _check_yaml(code: str) -> None:
    data = yaml.safe_load(code)
    if isinstance(data, dict) and "merge_method" in data:
        from ram_trl.merging.config.schema import MergeConfig

        MergeConfig.model_validate(data)
    elif isinstance(data, dict) and {"name", "base", "stages"} <= set(data):  # a whole recipe, not a fragment
        from ram_trl.recipes.schema import Recipe

        Recipe.model_validate(data)


def _check_bash(code: str) -> None:
    if shutil.which("bash"):
        done = subprocess.run(["bash", "-n"], input=code, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    from ram_trl.cli_parser import build_parser

    for line in code.replace("\\\n", " ").splitlines():
        command = re.sub(r"\[[^\]]*\]", "", line.split("#", 1)[0]).strip()  # [--optional FLAGS] left out
        words = shlex.split(command) if command else []
        if "ram-trl" in words:
            args = words[words.index("ram-trl") + 1 :]
        elif "ram_trl" in words and "-m" in words:
            args = words[words.index("ram_trl") + 1 :]
        else:
            continue
        if not args or any("..." in w or w.startswith("<") for w in args):
            continue
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            raise AssertionError(f"`ram-trl {' '.join(args)}` does not parse (exit {exc.code})") from None


#: What the docs name -> what the run uses: tiny models built from a config (``models`` below), tiny sample counts.
SUBSTITUTE = {
    "Qwen/Qwen2.5-7B-Instruct": "./base",
    "Gen-Verse/ReasonFlux-Coder-7B": "./coder",
    "emrecanacikgoz/Qwen2.5-7B-Instruct-ToolRL-grpo-cold": "./tool-agent",
    "BytedTsinghua-SIA/RL-MemoryAgent-7B@main": "./memory-agent",
    "BytedTsinghua-SIA/RL-MemoryAgent-7B": "./memory-agent",
    "../models/Qwen2.5-1.5B-Instruct": "./base",
    "../models/my-memory-agent": "./memory-agent",
    "./Qwen2.5-7B-Instruct": "./base",
    "./Qwen2.5-1.5B-Instruct": "./base",
    "./grpo-coding": "./coder",
    '"models/base"': '"./base"',
    "--num-samples 256": "--num-samples 2",
    "num_samples=256": "num_samples=2",
    "--max-new-tokens 128": "--max-new-tokens 4",
    "max_new_tokens=128": "max_new_tokens=4",
    '"max_new_tokens": 32': '"max_new_tokens": 4',
    "max_completion_length=256": "max_completion_length=8",
}
#: Files the snippets read, beside the models (a ``merge.yaml`` of the page, if it has one, replaces this one).
FILES = {
    "merge.yaml": "merge_method: ram_plus\nbase_model: ./base\nmodels:\n  - model: ./coder\n  - model: ./tool-agent\n"
    "  - model: ./memory-agent\nparameters: {r: 0.1, alpha: 2.0}\n",
    "coding_prompts.jsonl": '{"prompt": "2+3="}\n{"prompt": "4+4="}\n',
    "tool_prompts.txt": "call add(2, 3)\ncall mul(4, 4)\n",
    "my_pkg/__init__.py": "",  # the user's reward functions (a TRL reward: one score per completion)
    "my_pkg/rewards.py": "def coding(completions, **kwargs):\n    return [float('def ' in c) for c in completions]\n\n\n"
    "def tools(completions, **kwargs):\n    return [float('(' in c) for c in completions]\n",
}
#: Bash lines that are not run, and why.
LINES_NOT_RUN = {
    r"^make ": "make demo / make test are the demo and this suite",
    r"^(python -m )?pip |^unzip ": "installs or downloads from the network",
    r"^(torchrun|accelerate launch) ": "several processes: tests/test_distributed*.py and tests/merging run them",
    r"^(nice )?(PYTHONPATH=\S+ )?ram-trl (run|demo)\b(?!.*--dry-run)": "trains every stage of a recipe (minutes to "
    "hours): tests/recipes/test_runner.py runs the quick demo",
    r"RECIPE\.yaml|runs/|convert-gguf": "a placeholder, a finished run or stage, or a downloaded file",
}
_NAMED_FILE = re.compile(r"^# (\S+\.ya?ml): ")
#: The stages a Python snippet names as trained before (``prior_stages=[...]``): the run supplies them.
_PRIOR_STAGES = re.compile(r"prior_stages=\[([^\]]*)\]")


#: A Python snippet that ends the page's previous one: ``# the end of the script above, from its LINE:``.
_ENDS_SCRIPT = re.compile(r"^# the end of the script above, from its (.+):\n")


def _script(where: str, code: str) -> str:
    """The snippet as run: after the lines of the page's previous Python snippet before LINE if it ends that one."""
    ends = _ENDS_SCRIPT.match(code)
    if ends is None:
        return code
    earlier = _earlier(where, "python")
    assert earlier, f"{where} ends the script above, but no Python snippet is above it"
    lines = earlier[-1].splitlines()
    start = [line.split("#", 1)[0].strip() for line in lines]
    assert ends.group(1) in start, f"{where}: the script above has no line {ends.group(1)}"
    return "\n".join(lines[: start.index(ends.group(1))]) + "\n" + code


#: A Python snippet that is a file of the package (``# ram_trl/methods/sign_mean.py``), or its end (``...: at the end``).
_PACKAGE_FILE = re.compile(r"^# (ram_trl/\S+\.py)(: at the end)?\n")


def _run_in_package(where: str, code: str, work: Path) -> None:
    """The end of a package file, as pasted, in a copy of the package holding the page's earlier package files (each
    imported beside the others where it is imported): the edited module imports in a fresh interpreter."""
    shutil.copytree(REPO / "ram_trl", work / "ram_trl", ignore=shutil.ignore_patterns("__pycache__"))
    target = _PACKAGE_FILE.match(code).group(1)
    for text in _earlier(where, "python"):
        named = _PACKAGE_FILE.match(text)
        if named and not named.group(2):  # a new file of the package
            (work / named.group(1)).write_text(text, encoding="utf-8")
            package, module = named.group(1)[:-3].replace("/", ".").rsplit(".", 1)
            edited = (work / target).read_text(encoding="utf-8")
            beside = f"from {package} import "  # the module imported beside the others
            assert beside in edited, f"{target} imports nothing from {package}: the page's step is stale"
            (work / target).write_text(edited.replace(beside, f"{beside}{module}\n{beside}", 1), encoding="utf-8")
    with (work / target).open("a", encoding="utf-8") as file:
        file.write("\n" + code)
    module = target[:-3].replace("/", ".")  # imported from the copy: its edited lines run
    _run([sys.executable, "-c", f"import os, {module} as m; assert m.__file__.startswith(os.getcwd())"], work, where)


def _substituted(code: str) -> str:
    for old, new in SUBSTITUTE.items():
        code = code.replace(old, new)
    return code


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """A tiny base (Qwen2, hidden size 64), three RL-like agents and a LoRA adapter, under the docs' names."""
    from transformers import AutoModelForCausalLM

    from ram_trl.synthetic import generate_example
    from tests.helpers import lora_adapter

    root = tmp_path_factory.mktemp("docs_models")
    made = generate_example(root)
    for agent, name in zip(made["agents"], ("coder", "tool-agent", "memory-agent"), strict=True):
        Path(agent).rename(root / name)
    (root / "merge.yaml").unlink()
    model = AutoModelForCausalLM.from_pretrained(root / "base")
    lora_adapter(model, root / "grpo-tools-lora", r=4, target_modules=["q_proj", "v_proj"])
    return root


def _workdir(tmp_path: Path, models: Path, where: str, code: str = "") -> Path:
    work = tmp_path / "work"
    shutil.copytree(models, work)
    for name, text in FILES.items():
        (work / name).parent.mkdir(exist_ok=True)
        (work / name).write_text(text, encoding="utf-8")
    for stages in _PRIOR_STAGES.findall(code):  # agents trained before: stages of the tool agent on ./base
        for path in re.findall(r"[\"']([^\"']+)[\"']", stages):
            shutil.copytree(models / "tool-agent", work / path)
            write_stage(work, Path(path).name, work / path, models / "base")
    for text in _earlier(where, "yaml"):  # the files the page's earlier snippets name
        named = _NAMED_FILE.match(text)
        if named:
            (work / named.group(1)).write_text(_substituted(text), encoding="utf-8")
    return work


def _line(where: str) -> int:
    return int(where.rsplit(":", 1)[1])


def _earlier(where: str, kind: str) -> list[str]:
    """The snippets of ``kind`` above ``where`` on its page, in order."""
    page = where.rsplit(":", 1)[0]
    return [c for w, k, c, _ in SNIPPETS if w.rsplit(":", 1)[0] == page and k == kind and _line(w) < _line(where)]


def _run(command: list[str], work: Path, what: str, stdin: str | None = None) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(command, cwd=work, env=env, input=stdin, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{what} failed as pasted (exit {done.returncode}):\n{done.stderr[-3000:]}"


def _lines(code: str) -> list[str]:
    """The snippet's command lines (continuations joined), without the ones ``LINES_NOT_RUN`` names."""
    lines = [line.strip() for line in code.replace("\\\n", " ").splitlines()]
    return [
        line
        for line in lines
        if line and not line.startswith("#") and not any(re.search(p, line) for p in LINES_NOT_RUN)
    ]


@pytest.mark.parametrize("where, kind, code, not_run", SNIPPETS, ids=[s[0] for s in SNIPPETS])
def test_snippet(where, kind, code, not_run, models, tmp_path):
    {"python": _check_python, "yaml": _check_yaml, "bash": _check_bash}[kind](code)
    if not_run is not None or kind == "yaml":  # YAML: validated above, run by the commands that read it
        return
    if kind == "bash":
        lines = _lines(_substituted(code))
        if lines:
            work = _workdir(tmp_path, models, where)
            for line in lines:
                _run(["bash", "-e", "-c", line], work, f"{where}: `{line}`")
        return
    named = _PACKAGE_FILE.match(code)
    if named and named.group(2):
        _run_in_package(where, code, _workdir(tmp_path, models, where))
        return
    code = _substituted(_script(where, code))
    _run([sys.executable, "-"], _workdir(tmp_path, models, where, code), where, stdin=code)


def test_not_run_lines_match_something():
    """Every pattern of LINES_NOT_RUN still names a line of the docs (a stale entry hides nothing)."""
    lines = [line for _, kind, code, _ in SNIPPETS if kind == "bash" for line in code.splitlines()]
    for pattern in LINES_NOT_RUN:
        assert any(re.search(pattern, line.strip()) for line in lines), pattern
