"""ram_trl/defaults.py: the shared defaults have the paper's values and are the ones the entry points use."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import ram_trl
from ram_trl import defaults
from ram_trl.sizes import parse_size


def test_the_papers_values():
    assert (defaults.EPS, defaults.R, defaults.ALPHA) == (1e-5, 0.1, 2.0)
    assert defaults.MERGEKIT_TL_ALPHA == 0.2


def test_sizes_parse_as_decimal_units():
    assert parse_size(defaults.MAX_SHARD_SIZE) == 5 * 10**9
    assert parse_size(defaults.CHUNK_BUDGET) == 256 * 10**6


def test_merge_reads_them():
    parameters = inspect.signature(ram_trl.merge).parameters
    assert parameters["max_shard_size"].default == 5 * 10**9
    assert parameters["chunk_budget"].default == 256 * 10**6


def test_the_module_imports_nothing():
    tree = ast.parse(Path(defaults.__file__).read_text())
    imports = [node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom)]
    assert [ast.unparse(node) for node in imports] == ["from __future__ import annotations"]
