"""The streaming engine on hand-computed inputs: global rho versus tensor-local rho, every branch of eq. 7."""

from __future__ import annotations

import copy
import io
import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl
import ram_trl.merging.engine
from ram_trl.errors import ConfigError
from ram_trl.merging.config.resolve import resolve_config
from ram_trl.merging.config.schema import load_config
from ram_trl.merging.context import MergeOptions
from ram_trl.merging.engine import check_device, check_weight_sums, run_merge
from ram_trl.merging.report import print_summary
from tests.helpers import BASE, TAUS, config_for, make_checkpoints, random_fisher, write_golden

F = torch.float32


@pytest.fixture
def golden(tmp_path):
    write_golden(tmp_path)
    return tmp_path


def _config(root, method, **params):
    return {
        "merge_method": method,
        "base_model": str(root / "base"),
        "models": [{"model": str(root / f"agent{t}")} for t in range(3)],
        "parameters": params,
    }


def _merged(root, out):
    state = load_file(str(out / "model.safetensors"))
    return torch.cat([state["A"], state["B"]])


def _expected(lambdas_a, lambdas_b):
    # The agents' deltas are recomputed from the stored float32 values, as the engine sees them.
    agents = BASE + TAUS
    tau = agents - BASE
    out = BASE.clone()
    lam = [lambdas_a] * 4 + [lambdas_b] * 3
    out[1] = BASE[1] + torch.tensor(lam[1][0], dtype=F) * tau[0, 1]
    out[2] = BASE[2] + (tau[0, 2] + tau[1, 2]) / 2
    out[3] = BASE[3] + (tau[0, 3] + tau[1, 3] + tau[2, 3]) / 3
    out[5] = BASE[5] + torch.tensor(lam[5][1], dtype=F) * tau[1, 5]
    out[6] = BASE[6] + torch.tensor(lam[6][0], dtype=F) * tau[0, 6]
    return out


def test_global_rho_uses_counts_of_the_whole_model(golden):
    # Whole model: agent 0 unique 2 / shared 2 -> rho 1; agent 1 unique 1 / shared 2 -> rho 2 (clipped to 1.5);
    # agent 2 shared 1, no unique -> rho inf (clipped to 1.5).
    report = ram_trl.merge(_config(golden, "ram_plus", r=0.1, alpha=1.5), golden / "out", progress=False)
    lambdas = [a["lambda"] for a in report["agents"]]
    assert lambdas == pytest.approx([1.1, 1.15, 1.15])
    assert [a["unique"] for a in report["agents"]] == [2, 1, 0]
    assert [a["shared"] for a in report["agents"]] == [2, 2, 1]
    assert report["agents"][2]["rho"] == "inf"
    assert report["agents"][0]["density"] == pytest.approx(4 / 7)
    merged = _merged(golden, golden / "out")
    assert torch.equal(merged, _expected([1.1, 1.15, 1.15], [1.1, 1.15, 1.15]))
    assert merged[4] == BASE[4] and merged[0] == BASE[0]  # |tau| == eps and c == 0 keep the base
    assert merged[2] == BASE[2] + 0.375 and merged[3] == BASE[3] + 0.25  # means of the shared elements


def test_tensor_local_rho_differs_from_global(golden):
    # Tensor A: agent 0 unique 1 / shared 2 -> rho 2 -> lambda 1 + 0.1 * 1.5; agents 1, 2 have no unique element.
    # Tensor B: agents 0 and 1 only unique elements -> rho 0 -> lambda 1.
    ram_trl.merge(_config(golden, "ram_plus", r=0.1, alpha=1.5, rho_scope="tensor"), golden / "out", progress=False)
    merged = _merged(golden, golden / "out")
    assert torch.equal(merged, _expected([1.15, 1.15, 1.15], [1.0, 1.0, 1.0]))
    global_merged = ram_trl.merge(_config(golden, "ram_plus", r=0.1, alpha=1.5), golden / "g", progress=False)
    assert global_merged["agents"][0]["lambda"] == pytest.approx(1.1)


def test_mergekit_ramplus_tl_alias_is_tensor_local_with_alpha_0_2(golden):
    report = ram_trl.merge(_config(golden, "ramplus_tl", r=0.1), golden / "out", progress=False)
    assert report["parameters"]["rho_scope"] == "tensor"
    assert report["parameters"]["alpha"] == 0.2
    merged = _merged(golden, golden / "out")
    assert torch.equal(merged, _expected([1.02, 1.02, 1.02], [1.0, 1.0, 1.0]))


def test_ram_has_no_rescale(golden):
    ram_trl.merge(_config(golden, "ram"), golden / "out", progress=False)
    assert torch.equal(_merged(golden, golden / "out"), _expected([1.0] * 3, [1.0] * 3))


def test_soft_variant(golden):
    report = ram_trl.merge(_config(golden, "ram_plus_soft", r=0.1), golden / "out", progress=False)
    soft = [1.05, 1 + 0.1 * 2 / 3, 1.1]
    assert [a["lambda"] for a in report["agents"]] == pytest.approx(soft)
    assert torch.equal(_merged(golden, golden / "out"), _expected(soft, soft))


def test_agent_without_any_unique_element_gets_alpha(golden):
    report = ram_trl.merge(_config(golden, "ram_plus", r=0.1, alpha=2.0), golden / "out", progress=False)
    assert report["agents"][2]["unique"] == 0
    assert report["agents"][2]["lambda"] == pytest.approx(1.2)
    assert math.isclose(report["agents"][1]["lambda"], 1.2)


def test_single_agent_c_is_0_or_1(golden):
    config = _config(golden, "ram_plus", r=0.1, alpha=2.0)
    config["models"] = config["models"][:1]
    report = ram_trl.merge(config, golden / "out", progress=False)
    # one agent: every active element is unique, rho = 0, lambda = 1: the agent is reproduced (minus |tau| <= eps)
    assert report["agents"][0]["lambda"] == 1.0
    merged = _merged(golden, golden / "out")
    expected = BASE + TAUS[0]
    expected[4] = BASE[4]
    assert torch.equal(merged, expected)


def test_eps_parameter_and_mergekit_epsilon_name(golden):
    ram_trl.merge(_config(golden, "ram", epsilon=0.35), golden / "out", progress=False)
    merged = _merged(golden, golden / "out")
    # only |tau| > 0.35 is active: e1 (agent 0 alone), e2 (agent 1 alone), e3 (all three: mean 0.25)
    expected = BASE.clone()
    expected[1] = BASE[1] + 0.5
    expected[2] = BASE[2] + 0.5
    expected[3] = BASE[3] + 0.25
    assert torch.equal(merged, expected)


def test_output_dtype_and_report_files(golden):
    config = _config(golden, "ram_plus")
    config["out_dtype"] = "bfloat16"
    ram_trl.merge(config, golden / "out", progress=False)
    state = load_file(str(golden / "out" / "model.safetensors"))
    assert state["A"].dtype == torch.bfloat16
    assert json.loads((golden / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    report = json.loads((golden / "out" / "ram_merge_report.json").read_text())
    assert report["merge_method"] == "ram_plus"
    card = (golden / "out" / "README.md").read_text()
    assert "RAM+" in card and "lambda_t" in card and "merge_method: ram_plus" in card


def test_a_library_merge_prints_nothing_and_logs_one_line(golden, capfd, caplog):
    # a merge called from Python (e.g. inside a trainer by the merge preview) leaves the terminal alone and logs
    # through the ram_trl.merging.engine logger; print_summary=True prints the tables that ram-trl merge shows
    config = _config(golden, "ram_plus")
    with caplog.at_level(logging.INFO, logger="ram_trl"):
        ram_trl.merge(config, golden / "out", progress=False)
        ram_trl.merge(config, golden / "plan", progress=False, dry_run=True)
    assert capfd.readouterr() == ("", "")
    lines = [r.getMessage() for r in caplog.records if r.name == "ram_trl.merging.engine"]
    assert lines == [f"ram_plus merge of 3 agents -> {golden / 'out'}: 28 bytes in 1 file(s) in " + lines[0][-5:]]
    ram_trl.merge(config, golden / "out", progress=False, overwrite=True, print_summary=True)
    ram_trl.merge(config, golden / "plan", progress=False, dry_run=True, print_summary=True)
    err = capfd.readouterr().err
    assert "agent" in err and "lambda_t" in err and "Merge plan" in err
    # the recipe runner writes the same table into its log file, without redirecting the process's streams
    report = ram_trl.merge(config, golden / "out", progress=False, overwrite=True)
    log = io.StringIO()
    print_summary(report, file=log)
    assert capfd.readouterr() == ("", "")
    text = " ".join(log.getvalue().split())
    assert "(RAM+)" in text and "wrote 28 B in 1 file(s)" in text, text
    assert " s on 1 process" in text, text  # how many processes ran, said plainly


def test_chat_template_without_a_tokenizer_is_not_written(tmp_path):
    """A chat template needs a tokenizer to belong to: without tokenizer files it is reported, not written alone."""
    ckpts = make_checkpoints(tmp_path / "in", num_agents=1)
    config = config_for(ckpts, "task_arithmetic", chat_template="{{ messages[0]['content'] }} and more text")
    report = ram_trl.merge(config, tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("chat_template*"))
    assert any("chat_template not written" in w for w in report["warnings"])
    (ckpts.base / "tokenizer_config.json").write_text("{}")
    ram_trl.merge(config, tmp_path / "with", progress=False)
    assert (tmp_path / "with" / "chat_template.jinja").read_text() == "{{ messages[0]['content'] }} and more text"


def test_a_merge_leaves_the_validated_config_as_it_was(golden, monkeypatch):
    # the engine learns each agent's Fisher file (and kind, notes, the LoRA export's float32) in its own copy: the
    # caller's validated config is the same after the run, and the device is checked once
    for t in range(3):
        state = load_file(str(golden / f"agent{t}" / "model.safetensors"))
        save_file(random_fisher(state, seed=t), str(golden / f"agent{t}" / "fisher.safetensors"))
    resolved = resolve_config(*load_config(_config(golden, "fisher")))
    before = copy.deepcopy(resolved)
    checked = []
    monkeypatch.setattr(ram_trl.merging.engine, "check_device", checked.append)
    run_merge(resolved, golden / "out", MergeOptions(progress=False))
    assert resolved == before and resolved.agents[0].parameters["fisher"] == ""  # as validated: the default
    assert checked == ["cpu"]
    run_merge(resolved, golden / "again", MergeOptions(progress=False))
    report = json.loads((golden / "again" / "ram_merge_report.json").read_text())
    assert report["agents"][0]["parameters"]["fisher"] == str(golden / "agent0" / "fisher.safetensors")
    checked.clear()
    ram_trl.merge(_config(golden, "ram_plus"), golden / "ram", progress=False)
    assert checked == ["cpu"]


def test_weight_sums():
    check_weight_sums({"a": 1.0, "b": -2.0, "c": 1e-8}, "m.yaml", "linear")
    for bad in (0.0, 5e-9, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"^m.yaml: linear with normalize: the agents' weights for tensor 'b'"):
            check_weight_sums({"a": 1.0, "b": bad}, "m.yaml", "linear")


def test_devices():
    assert check_device("cpu") == torch.device("cpu")
    for bad in ("tpu", "gpu", "", None):
        with pytest.raises(ConfigError, match="unknown device; use cpu, cuda or cuda:N"):
            check_device(bad)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device is available"):
            check_device("cuda")
