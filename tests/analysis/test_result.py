"""ram_trl/analysis/result.py: the JSON-ready values and dtype summary of ``analysis.json`` (the assembled result
is checked end to end in tests/test_analysis.py)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from ram_trl.analysis.result import clean, dtype_summary
from ram_trl.io.checkpoint import open_checkpoint


def test_clean_makes_json_ready_copies():
    value = {"a": [1.0, float("inf"), (float("-inf"), float("nan"))], "b": {"c": 2, "d": "x", "e": None}}
    cleaned = clean(value)
    assert cleaned == {"a": [1.0, "inf", ["-inf", None]], "b": {"c": 2, "d": "x", "e": None}}
    assert json.loads(json.dumps(cleaned, allow_nan=False)) == cleaned
    assert value["a"][1] == float("inf")  # the input is not modified


def test_dtype_summary_counts_elements_most_first(tmp_path):
    tensors = {
        "a": torch.zeros(2, 3, dtype=torch.bfloat16),
        "b": torch.zeros(11, dtype=torch.float32),
        "c": torch.zeros(4, dtype=torch.bfloat16),
        "step": torch.zeros((), dtype=torch.int64),
    }
    save_file(tensors, str(tmp_path / "model.safetensors"))
    summary = dtype_summary(open_checkpoint(tmp_path, "agent 0"))
    assert summary == {"float32": 11, "bfloat16": 10, "int64": 1}
    assert list(summary) == ["float32", "bfloat16", "int64"]
