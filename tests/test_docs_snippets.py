"""Every fenced python / bash / yaml snippet of README.md and docs/ as pasted: checked, then run at tiny sizes.

Checked: YAML parses and validates against the schema it is written for (merge config, recipe), Python compiles, its
``ram_trl`` imports exist and its TRL configs name real fields (with ``bf16`` said explicitly: TRL's configs default it
on, which a CPU refuses), bash is valid and every ``ram-trl`` command line parses.

Run: each Python snippet (a fresh interpreter) and each bash line (bash, the installed ``ram-trl``), in a fresh
directory holding tiny models built from a config under the names the docs use (``SUBSTITUTE`` maps the Hub ids and
paths the docs name to them, and the sample counts to tiny ones), ``FILES``, and the files the page's earlier YAML
snippets name on their first line (``# merge.yaml: ...``). A bash line matching ``LINES_NOT_RUN`` is not run (each
pattern says why); a Python snippet that cannot run as pasted says why on the line before its fence, visibly:
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

pytestmark = (
    pytest.mark.slow
)  # imports TRL and parses every command line: about 2 minutes on a loaded 2-core machine

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
        if (
            isinstance(node, ast.ImportFrom)
            and node.module
            and node.module.split(".")[0] in ("ram_trl", "trl")
        ):
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
    "--num-samples 256": "--num-samples 2",
    "num_samples=256": "num_samples=2",
    "--max-new-tokens 128": "--max-new-tokens 4",
    "max_new_tokens=128": "max_new_tokens=4",
}
#: Files the snippets read, beside the models (a ``merge.yaml`` of the page, if it has one, replaces this one).
FILES = {
    "merge.yaml": "merge_method: ram_plus\nbase_model: ./base\nmodels:\n  - model: ./coder\n  - model: ./tool-agent\n"
    "  - model: ./memory-agent\nparameters: {r: 0.1, alpha: 2.0}\n",
    "coding_prompts.jsonl": '{"prompt": "2+3="}\n{"prompt": "4+4="}\n',
    "tool_prompts.txt": "call add(2, 3)\ncall mul(4, 4)\n",
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


def _workdir(tmp_path: Path, models: Path, where: str) -> Path:
    work = tmp_path / "work"
    shutil.copytree(models, work)
    for name, text in FILES.items():
        (work / name).write_text(text, encoding="utf-8")
    page = where.rsplit(":", 1)[0]
    for other, kind, code, _ in SNIPPETS:  # the files the page's earlier snippets name
        named = _NAMED_FILE.match(code)
        if other.rsplit(":", 1)[0] == page and kind == "yaml" and named and _line(other) < _line(where):
            (work / named.group(1)).write_text(_substituted(code), encoding="utf-8")
    return work


def _line(where: str) -> int:
    return int(where.rsplit(":", 1)[1])


def _run(command: list[str], work: Path, what: str, stdin: str | None = None) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    done = subprocess.run(
        command, cwd=work, env=env, input=stdin, capture_output=True, text=True, timeout=600
    )
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
    _run([sys.executable, "-"], _workdir(tmp_path, models, where), where, stdin=_substituted(code))


def test_not_run_lines_match_something():
    """Every pattern of LINES_NOT_RUN still names a line of the docs (a stale entry hides nothing)."""
    lines = [line for _, kind, code, _ in SNIPPETS if kind == "bash" for line in code.splitlines()]
    for pattern in LINES_NOT_RUN:
        assert any(re.search(pattern, line.strip()) for line in lines), pattern
