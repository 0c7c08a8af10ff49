"""ram_trl.merging.report: the merge report, the model card and the dry-run summary, on the hand-computed golden inputs.

The golden task vectors (``tests/helpers.py``: ``BASE``, ``TAUS``; 7 elements in two tensors, eps = 1e-5):

| agent | active elements | unique | shared | rho | lambda_t (r 0.1, alpha 2) |
|---|---|---|---|---|---|
| 0 | e1, e2, e3, e6 (e4 sits at eps: inactive) | e1, e6 | e2, e3 | 1 | 1.1 |
| 1 | e2, e3, e5 | e5 | e2, e3 | 2 | 1.2 |
| 2 | e3 | - | e3 | inf | 1 + 0.1 * 2 = 1.2 |
"""

from __future__ import annotations

import json

import pytest
import yaml

import ram_trl
from ram_trl.merging.report import model_card
from tests.helpers import write_golden


@pytest.fixture
def config(tmp_path):
    write_golden(tmp_path)
    return {
        "merge_method": "ram_plus",
        "base_model": str(tmp_path / "base"),
        "models": [{"model": str(tmp_path / f"agent{t}")} for t in range(3)],
        "parameters": {"r": 0.1, "alpha": 2.0},
    }


def test_report_counts_rho_and_lambda(config, tmp_path):
    report = ram_trl.merge(config, tmp_path / "out", progress=False)
    assert json.loads((tmp_path / "out" / "ram_merge_report.json").read_text()) == json.loads(json.dumps(report))
    assert report["merge_method"] == "ram_plus" and report["method_pretty_name"]
    assert report["parameters"] == {"eps": 1e-5, "r": 0.1, "alpha": 2.0, "rho_scope": "global"}
    assert report["total_elements"] == 7 and report["num_agents"] == 3
    got = [(a["active"], a["unique"], a["shared"], a["rho"], a["lambda"]) for a in report["agents"]]
    assert got == [(4, 2, 2, 1.0, pytest.approx(1.1)), (3, 1, 2, 2.0, pytest.approx(1.2)), (1, 0, 1, "inf", 1.2)]
    assert [a["density"] for a in report["agents"]] == [4 / 7, 3 / 7, 1 / 7]
    assert [a["name"] for a in report["agents"]] == ["agent0", "agent1", "agent2"]
    assert report["output"] == {
        "dtype": "base",
        "files": ["model.safetensors"],
        "bytes": 28,
        "tensors": 2,
        "resized_tensors": [],
    }
    assert report["arithmetic_dtype"] == "float32" and report["seed"] == 0
    assert report["config"]["merge_method"] == "ram_plus"


def test_model_card(config, tmp_path):
    report = ram_trl.merge(config, tmp_path / "out", progress=False)
    card = (tmp_path / "out" / "README.md").read_text()
    assert card == model_card(report)
    front = yaml.safe_load(card.split("---")[1])
    assert front == {  # the Hub's merge convention: every input, local paths by their folder's name
        "base_model": ["base", "agent0", "agent1", "agent2"],
        "base_model_relation": "merge",
        "library_name": "transformers",
        "tags": ["merge", "ram_trl", "ram_plus"],
    }
    assert "| 0 | `agent0` | full | 57.1429% | 4 | 2 | 2 | 1.0000 | 1.1000 |" in card
    assert "| 2 | `agent2` | full | 14.2857% | 1 | 0 | 1 | inf | 1.2000 |" in card
    assert (
        "Counts are over 7 elements of the floating-point tensors; an element is active when |tau| > eps = 1e-05."
        in card
    )
    assert "- `r`: 0.1" in card and "## Configuration" in card
    assert "Output: 1 safetensors file(s), 28 B.\n\n## Upload\n\n```bash\nhf upload YOUR_ORG/YOUR_MODEL" in card
    assert "## Stages" not in card
    assert "](http" not in card.replace(f"]({report['reference']})", "")  # no link but the paper's
    assert f"## Warnings\n\n- no tokenizer files found in {config['base_model']}" in card


def test_model_card_sections_for_warnings_lora_and_tensor_scope(config, tmp_path):
    config["parameters"]["rho_scope"] = "tensor"
    report = ram_trl.merge(config, tmp_path / "out", progress=False)
    # tensor-local rho: lambda_t is the mean over the agent's unique elements of its per-tensor values
    # agent 0: unique e1 (tensor A: rho 2 -> 1.2) and e6 (tensor B: no shared element -> rho 0 -> 1.0)
    agent0 = report["agents"][0]
    assert agent0["lambda_scope"] == "tensor"
    assert (agent0["lambda_min"], agent0["lambda_max"]) == (pytest.approx(1.0), pytest.approx(1.2))
    assert agent0["lambda"] == pytest.approx(1.1)
    assert report["agents"][2]["lambda"] is None  # no unique element in any tensor
    card = model_card(report)
    assert "(per tensor, 1.0000-1.2000)" in card
    report["warnings"] = ["agent 2 changed only 1 element"]
    report["agents"][1]["kind"] = "lora"
    card = model_card(report)
    assert "## Warnings\n\n- agent 2 changed only 1 element" in card
    assert "LoRA agents contribute the dense delta B @ A * scaling" in card


def test_dry_run_plans_with_the_input_cache(config, tmp_path, capsys):
    def plan(cache):
        return ram_trl.merge(config, tmp_path / "out", dry_run=True, progress=False, input_cache=cache)

    off, cached = plan("off"), plan("1MB")
    assert off["input_cache"] == 0 and off["bytes_read"] == 2 * 4 * 28
    # the statistics pass keeps all 4 * 28 input bytes: the merge pass reads none again, and they are held
    assert cached["input_cache"] == 4 * 28 and cached["bytes_read"] == 4 * 28
    assert cached["peak_memory_estimate"] == off["peak_memory_estimate"] + 4 * 28
    ram_trl.merge(config, tmp_path / "out", dry_run=True, progress=False, input_cache="1MB", print_summary=True)
    printed = " ".join(w for w in capsys.readouterr().err.split() if w != "│")
    assert "input cache up to 112 B of inputs kept for the merge pass" in printed, printed
    linear = ram_trl.merge(
        dict(config, merge_method="task_arithmetic", parameters={}),
        tmp_path / "out",
        dry_run=True,
        progress=False,
        input_cache="1MB",
    )
    assert linear["input_cache"] == 0 and linear["bytes_read"] == 4 * 28  # one pass: nothing to keep


def test_dry_run_summary(config, tmp_path, capsys):
    summary = ram_trl.merge(config, tmp_path / "out", dry_run=True, progress=False, print_summary=True)
    # the estimate separates the fixed overhead (the same for any model) from the merge's own buffers
    from ram_trl.merging.planner import PROCESS_BASELINE_BYTES
    from ram_trl.sizes import format_bytes

    assert summary["peak_memory_fixed"] == PROCESS_BASELINE_BYTES
    share = format_bytes(summary["peak_memory_estimate"] - PROCESS_BASELINE_BYTES)
    printed = " ".join(w for w in capsys.readouterr().err.split() if w != "│")
    assert f"{format_bytes(PROCESS_BASELINE_BYTES)} fixed (Python, torch, libraries) + {share} for this" in printed
    assert not (tmp_path / "out").exists()
    assert summary["dry_run"] is True and summary["merge_method"] == "ram_plus"
    assert (summary["tensors"], summary["merged_tensors"], summary["chunked_tensors"]) == (2, 2, 0)
    assert summary["passes"] == 2
    assert summary["bytes_read"] == 2 * 4 * 28  # two passes over base + 3 agents of 28 bytes
    assert summary["bytes_written"] == 28 and summary["output_files"] == ["model.safetensors"]
    assert summary["chunk_budget"] == 256_000_000
    assert [a["name"] for a in summary["agents"]] == ["agent0", "agent1", "agent2"]
