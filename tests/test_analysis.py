"""``ram_trl.analyze`` and ``ram-trl analyze``: golden values on hand-built checkpoints, the bf16 view, agreement
with the merge report, figures, the command line, bad input, and a 2-process run."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from matplotlib.image import imread
from safetensors.torch import load_file

import ram_trl
from ram_trl.cli import main
from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError, RamTrlError
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from tests._launch import free_port, run_job
from tests.helpers import BASE, GOLDEN_CONFIG, save_checkpoint, write_golden

# The seven elements of tests/merging/test_engine_golden.py (dyadic, so base + tau is exact in float32), in two tensors:
# A = e0..e3, B = e4..e6. e0: no agent; e1: agent 0; e2: agents 0, 1; e3: all three; e4: agent 0 at exactly eps
# (inactive, but the stored value differs); e5: agent 1 (2e-5); e6: agent 0.
F = torch.float32


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    return save_checkpoint(path, tensors, config=GOLDEN_CONFIG)


@pytest.fixture
def golden(tmp_path) -> tuple[Path, list[Path]]:
    return write_golden(tmp_path)


def test_golden_counts_densities_rho_lambda_jaccard(golden):
    base, agents = golden
    result = ram_trl.analyze(base, agents, r=0.1, alpha=2.0, progress=False)
    assert result["total_elements"] == 7 and result["tensors"] == 2 and result["num_agents"] == 3
    got = {key: [a[key] for a in result["agents"]] for key in result["agents"][0]}
    assert got["name"] == ["agent0", "agent1", "agent2"]
    assert got["active"] == [4, 3, 1]
    assert got["unique"] == [2, 1, 0]
    assert got["shared"] == [2, 2, 1]
    assert got["density"] == [4 / 7, 3 / 7, 1 / 7]
    assert got["overlap_histogram"] == [[2, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert got["overlap_shares"] == [[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3], [0.0, 0.0, 1.0]]
    assert got["rho"] == [1.0, 2.0, "inf"]
    assert [lam["ram_plus"] for lam in got["lambda"]] == pytest.approx([1.1, 1.2, 1.2])
    assert [lam["ram_plus_soft"] for lam in got["lambda"]] == pytest.approx([1.05, 1 + 0.1 * 2 / 3, 1.1])
    # exact: e4 (1e-5 in float32) differs from the base although it is not above eps
    assert got["changed"] == [5, 3, 1]
    assert got["density_exact"] == [5 / 7, 3 / 7, 1 / 7]
    assert result["overall"]["element_counts"] == [2, 3, 1, 1]
    assert result["overall"]["element_counts_exact"] == [1, 4, 1, 1]
    assert result["overall"]["union"] == 5
    assert result["overall"]["density_any"] == 5 / 7
    assert result["jaccard"][0] == [1.0, 2 / 5, 1 / 4]
    assert result["jaccard"][1][2] == 1 / 3
    detail = {t["name"]: t for t in result["tensors_detail"]}
    assert detail["A"]["active"] == [3, 2, 1] and detail["B"]["active"] == [1, 1, 0]
    assert detail["B"]["changed"] == [2, 1, 0]
    assert detail["A"]["module"] == "other" and detail["A"]["layer"] is None
    assert result["anatomy"]["modules"] == [
        {
            "module": "other",
            "family": "other",
            "tensors": 2,
            "numel": 7,
            "density": [4 / 7, 3 / 7, 1 / 7],
            "density_exact": [5 / 7, 3 / 7, 1 / 7],
            "density_bf16": [5 / 7, 3 / 7, 1 / 7],
            "density_any": 5 / 7,
        }
    ]
    assert result["anatomy"]["layers"] == []


def test_golden_magnitudes(golden):
    base, agents = golden
    result = ram_trl.analyze(base, agents, progress=False)
    # agent 0's active values 0.5, 0.25, 0.375, 0.125 (each alone in its histogram bin: the estimates are exact)
    m = result["agents"][0]["magnitude"]
    assert m["count"] == 4
    assert m["mean_abs"] == 0.3125
    assert m["mean"] == 0.3125
    assert m["excess_kurtosis"] == pytest.approx(-1.36)
    assert m["gini"] == pytest.approx(0.25)
    assert m["top_1pct_mass"] == pytest.approx(0.4) and m["top_5pct_mass"] == pytest.approx(0.4)
    # over the 7 elements with the 3 inactive ones at 0: sorted 0, 0, 0, 1, 2, 3, 4 (x 0.125), sum 10:
    # G = ((2*4-8) * 1 + (2*5-8) * 2 + (2*6-8) * 3 + (2*7-8) * 4) / (7 * 10) = (0 + 4 + 12 + 24) / 70
    assert m["gini_masked"] == pytest.approx(40 / 70)
    # agent 2 has one active value: no spread, so kurtosis is undefined; all of its mass is in its top element
    m2 = result["agents"][2]["magnitude"]
    assert m2["count"] == 1 and m2["excess_kurtosis"] is None and m2["gini"] == 0.0
    assert m2["top_1pct_mass"] == 1.0
    assert result["magnitude_estimates"]["gini_max_error"] == 2.0**-9
    assert result["magnitude_estimates"]["fourth_power_sum_max_relative_error"] < 1e-4


def test_bf16_view_of_float32_checkpoints(tmp_path):
    # base: bf16-representable values stored in float32. Agent: 16 elements moved by 1e-3 (below half a bf16 step
    # of 1.0, so a bf16 save rounds them back) and 8 by 0.0625 (a whole number of bf16 steps).
    base_values = torch.ones(8, 8, dtype=F)
    agent_values = base_values.clone()
    agent_values.view(-1)[:16] += 1e-3
    agent_values.view(-1)[16:24] += 0.0625
    base = _write(tmp_path / "base", {"w": base_values})
    agent = _write(tmp_path / "agent", {"w": agent_values})
    bf16_agent = _write(tmp_path / "bf16_agent", {"w": agent_values.to(torch.bfloat16)})
    result = ram_trl.analyze(base, [agent, bf16_agent], progress=False)
    a, b = result["agents"]
    assert a["density"] == a["density_exact"] == 24 / 64
    assert a["bf16_view"] is True
    assert a["active_bf16"] == 8 and a["density_bf16"] == 8 / 64
    # the bf16 agent against the float32 base: 1e-3 was already rounded away when it was saved
    assert b["density"] == 8 / 64 and b["density_bf16"] == 8 / 64
    assert a["dtypes"] == {"float32": 64} and b["dtypes"] == {"bfloat16": 64}
    assert result["base_dtypes"] == {"float32": 64}
    assert result["tensors_detail"][0]["dtypes"] == {"base": "float32", "agents": ["float32", "bfloat16"]}
    assert result["overall"]["element_counts_bf16"] == [56, 0, 8]


def test_bf16_view_only_for_agents_stored_wider_than_bf16(tmp_path):
    base_values = torch.ones(4, 4, dtype=torch.bfloat16)
    changed = base_values.clone()
    changed[0] += 0.5
    base = _write(tmp_path / "base", {"w": base_values})
    narrow = _write(tmp_path / "narrow", {"w": changed})
    wide = _write(tmp_path / "wide", {"w": changed.to(F)})
    result = ram_trl.analyze(base, [narrow, wide], progress=False)
    assert [a["bf16_view"] for a in result["agents"]] == [False, True]
    assert [a["density_bf16"] for a in result["agents"]] == [None, 4 / 16]
    assert result["agents"][0]["active_bf16"] is None


# ---------------------------------------------------------------------------------------------------------------
# Agreement with the merge, chunking, config


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, list[Path], Path]:
    root = tmp_path_factory.mktemp("synthetic")
    base = make_base_checkpoint(root / "base", hidden_size=32, num_layers=2, intermediate_size=64)
    agents = make_agent_set(base, root, densities=(0.03, 0.46, 0.54), seed=5)
    config = root / "merge.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "merge_method": "ram_plus",
                "base_model": str(base),
                "models": [{"model": str(a)} for a in agents],
                "parameters": {"r": 0.3, "alpha": 4.0, "eps": 2e-5},
            }
        )
    )
    return base, agents, config


SHARED_KEYS = ("active", "unique", "shared", "density", "rho", "overlap_histogram")


def test_analysis_agrees_with_the_merge_report(synthetic, tmp_path):
    base, agents, config = synthetic
    analysis = ram_trl.analyze(config=config, progress=False)
    assert analysis["parameters"] == {"eps": 2e-5, "r": 0.3, "alpha": 4.0}
    merged = ram_trl.merge(config, tmp_path / "plus", progress=False)
    soft_config = yaml.safe_load(config.read_text())
    soft_config["merge_method"] = "ram_plus_soft"
    del soft_config["parameters"]["alpha"]
    soft = ram_trl.merge(soft_config, tmp_path / "soft", progress=False)
    assert analysis["total_elements"] == merged["total_elements"] == 25_120
    for ours, plus, plus_soft in zip(analysis["agents"], merged["agents"], soft["agents"], strict=True):
        assert ours["name"] == plus["name"] and ours["path"] == plus["path"]
        for key in SHARED_KEYS:
            assert ours[key] == plus[key] == plus_soft[key], key
        assert ours["lambda"]["ram_plus"] == plus["lambda"]
        assert ours["lambda"]["ram_plus_soft"] == plus_soft["lambda"]
    assert len({a["lambda"]["ram_plus"] for a in analysis["agents"]}) > 1  # the numbers say something
    assert [a["density"] for a in analysis["agents"]] == pytest.approx([0.0255, 0.3982, 0.4666], abs=5e-5)


def test_config_and_arguments_give_the_same_numbers(synthetic):
    base, agents, config = synthetic
    from_config = ram_trl.analyze(config=config, progress=False)
    from_args = ram_trl.analyze(base, agents, eps=2e-5, r=0.3, alpha=4.0, progress=False)
    overridden = ram_trl.analyze(config=config, eps=1e-5, progress=False)
    for key in ("agents", "overall", "jaccard", "anatomy", "tensors_detail", "parameters"):
        assert from_config[key] == from_args[key], key
    assert overridden["parameters"] == {"eps": 1e-5, "r": 0.3, "alpha": 4.0}
    assert overridden["agents"][1]["active"] > from_config["agents"][1]["active"]


def assert_same_analysis(ours: dict, theirs: dict) -> None:
    """Two analyses of the same inputs agree: counts exactly, float64 sums of magnitudes to rounding."""
    for key in ("overall", "jaccard", "anatomy", "tensors_detail", "magnitude_histogram", "total_elements"):
        assert ours[key] == theirs[key], key
    assert ours["bytes_read"] == theirs["bytes_read"]
    for a, b in zip(ours["agents"], theirs["agents"], strict=True):
        assert {k: v for k, v in a.items() if k != "magnitude"} == {k: v for k, v in b.items() if k != "magnitude"}
        assert a["magnitude"].keys() == b["magnitude"].keys()
        for key, value in b["magnitude"].items():
            assert a["magnitude"][key] == (value if value is None else pytest.approx(value, rel=1e-12)), key


def test_small_chunks_give_the_same_result(synthetic):
    base, agents, _ = synthetic
    whole = ram_trl.analyze(base, agents, progress=False)
    chunked = ram_trl.analyze(base, agents, chunk_budget="2KB", progress=False)
    assert_same_analysis(chunked, whole)


def test_lora_agent_dense_on_its_targets_and_its_bf16_view(tmp_path):
    from tests.helpers import dense_lora_deltas, lora_adapter, qwen_model, save_base

    base = save_base(qwen_model(), tmp_path / "base")  # float32
    # a small scaling: part of the delta is below half a bf16 step of the weights it is added to
    peft_model = lora_adapter(
        qwen_model(), tmp_path / "lora", r=4, lora_alpha=0.01, target_modules=["q_proj", "up_proj"]
    )
    deltas = dense_lora_deltas(peft_model)
    state = load_file(str(base / "model.safetensors"))
    result = ram_trl.analyze(base, [tmp_path / "lora"], progress=False)
    merged = ram_trl.merge(
        {"merge_method": "ram_plus", "base_model": str(base), "models": [{"model": str(tmp_path / "lora")}]},
        tmp_path / "out",
        progress=False,
    )
    (agent,) = result["agents"]
    assert agent["kind"] == merged["agents"][0]["kind"] == "lora"
    for key in SHARED_KEYS:
        assert agent[key] == merged["agents"][0][key], key
    assert agent["active"] == sum(int((d.abs() > 1e-5).sum()) for d in deltas.values())
    # the bf16 view: PEFT's merged weights and the base, both saved in bf16
    bf16_active = sum(
        int((((state[n] + d).bfloat16().float() - state[n].bfloat16().float()).abs() > 1e-5).sum())
        for n, d in deltas.items()
    )
    assert agent["bf16_view"] is True and agent["active_bf16"] == bf16_active
    assert 0 < bf16_active < 0.9 * agent["active"]
    modules = {m["module"]: m for m in result["anatomy"]["modules"]}
    assert modules["mlp_down"]["density"] == [0.0] and modules["attn_k"]["density"] == [0.0]
    up_active = sum(int((d.abs() > 1e-5).sum()) for n, d in deltas.items() if "up_proj" in n)
    assert modules["mlp_up"]["density"] == [up_active / modules["mlp_up"]["numel"]]
    untouched = next(t for t in result["tensors_detail"] if t["name"].endswith("k_proj.weight"))
    assert untouched["dtypes"]["agents"] == [None] and untouched["active"] == [0]


# ---------------------------------------------------------------------------------------------------------------
# Outputs


def _check_outputs(out: Path, result: dict) -> None:
    assert json.loads((out / "analysis.json").read_text()) == result
    for name in ("density.png", "overlap.png", "anatomy.png", "magnitude.png"):
        path = out / name
        assert path.stat().st_size > 5_000, name
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 300, name
        assert float(image[..., :3].std()) > 0.05, name  # not a blank canvas
    assert result["figures"] == ["density.png", "overlap.png", "anatomy.png", "magnitude.png"]


def test_writes_json_markdown_and_figures(synthetic, tmp_path):
    base, agents, _ = synthetic
    out = tmp_path / "analysis"
    result = ram_trl.analyze(base, agents, out, progress=False)
    _check_outputs(out, result)
    text = (out / "analysis.md").read_text()
    first = result["agents"][0]
    assert f"| agent_0 | bf16 | {first['density']:.2%} |" in text
    assert "| attn_q | 4 | 2,112 |" in text
    assert "![overlap](overlap.png)" in text
    assert "### Density by decoder layer" in text and "| 1 | 9,344 |" in text


def test_figures_for_a_model_without_layers(golden, tmp_path):
    base, agents = golden
    out = tmp_path / "analysis"
    result = ram_trl.analyze(base, agents, out, progress=False)
    _check_outputs(out, result)
    assert "Density by decoder layer" not in (out / "analysis.md").read_text()


def test_cli_with_base_and_agents(synthetic, tmp_path, capsys):
    base, agents, _ = synthetic
    out = tmp_path / "out"
    argv = ["analyze", "--base", str(base), *map(str, agents), "--out", str(out), "--no-progress"]
    assert main([*argv, "--eps", "1e-5", "--r", "0.2", "--alpha", "1", "--names", "a", "b", "c"]) == 0
    captured = capsys.readouterr()
    assert "Task-vector sparsity at eps = 1e-05" in captured.out and "Magnitudes" in captured.out
    result = json.loads((out / "analysis.json").read_text())
    assert [a["name"] for a in result["agents"]] == ["a", "b", "c"]
    assert result["parameters"] == {"eps": 1e-5, "r": 0.2, "alpha": 1.0}
    api = ram_trl.analyze(base, agents, eps=1e-5, r=0.2, alpha=1.0, names=["a", "b", "c"], progress=False)
    assert result["agents"] == api["agents"]


def test_cli_with_config(synthetic, tmp_path):
    _, _, config = synthetic
    out = tmp_path / "out"
    assert main(["analyze", "--config", str(config), "--out", str(out), "--no-progress", "--no-figures"]) == 0
    result = json.loads((out / "analysis.json").read_text())
    assert result["parameters"] == {"eps": 2e-5, "r": 0.3, "alpha": 4.0}
    assert result["figures"] == [] and not list(out.glob("*.png"))


# ---------------------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--config", "CONFIG", "--base", "BASE", "AGENT"], "not both"),
        (["--base", "BASE"], "at least one agent"),
        (["AGENT"], "at least one agent"),
        (["--base", "BASE", "AGENT", "MISSING"], "agent 1: MISSING_PATH does not exist"),
        (["--base", "MISSING", "AGENT"], "base model: MISSING_PATH does not exist"),
        (["--base", "BASE", "BASE"], "every agent is the base model"),
        (["--base", "BASE", "AGENT", "--r", "-1"], "--r must be >= 0.0, got -1.0"),
        (["--config", "CONFIG", "--eps", "nan"], "--eps must be a finite number, got nan"),
        (["--base", "BASE", "AGENT", "--names", "x", "y"], "2 names given for 1 agents"),
        (["--config", "CONFIG", "--names", "x", "y"], "2 names given for 1 agents"),
        (["--config", "MISSING"], "merge config MISSING_PATH does not exist"),
    ],
)
def test_cli_refuses_bad_arguments(golden, tmp_path, capsys, argv, message):
    base, agents = golden
    config = tmp_path / "merge.yaml"
    config.write_text(
        yaml.safe_dump({"merge_method": "ram", "base_model": str(base), "models": [{"model": str(agents[0])}]})
    )
    paths = {"BASE": str(base), "AGENT": str(agents[0]), "CONFIG": str(config), "MISSING": str(tmp_path / "nope")}
    out = tmp_path / "out"
    assert main(["analyze", *(paths.get(a, a) for a in argv), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ram-trl analyze: error: ")
    assert message.replace("MISSING_PATH", paths["MISSING"]) in err
    assert not out.exists()


def test_refuses_output_inside_an_input(golden):
    base, agents = golden
    with pytest.raises(RamTrlError, match=r"overlaps the agent 1 \(agent1\)"):
        ram_trl.analyze(base, agents, agents[1] / "analysis", progress=False)
    assert not (agents[1] / "analysis").exists()


def test_refuses_mismatched_and_corrupt_checkpoints(golden, tmp_path):
    base, _ = golden
    other = _write(tmp_path / "other", {"A": torch.zeros(5), "B": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"agent 0 \(other.*'A' has shape \[5\].*has \[4\]"):
        ram_trl.analyze(base, [other], progress=False)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match="broken.*truncated"):
        ram_trl.analyze(base, [broken], progress=False)
    with pytest.raises(ConfigError, match="give a base model"):
        ram_trl.analyze(progress=False)


def test_refuses_nan_naming_the_agent_and_tensor(golden, tmp_path):
    base, _ = golden
    bad = _write(tmp_path / "bad", {"A": torch.tensor([1.0, float("nan"), 0.5, 2.0]), "B": BASE[4:]})
    with pytest.raises(NonFiniteError, match=r"agent 0 \(bad.*tensor 'A' holds 1 NaN/Inf"):
        ram_trl.analyze(base, [bad], progress=False)


def test_agent_identical_to_the_base_is_reported(golden, tmp_path):
    base, agents = golden
    copy = _write(tmp_path / "copy", {"A": BASE[:4], "B": BASE[4:]})
    with pytest.warns(UserWarning, match="density 0"):
        result = ram_trl.analyze(base, [agents[0], copy], progress=False)
    assert result["agents"][1]["active"] == 0
    assert result["agents"][1]["magnitude"]["mean_abs"] is None
    assert any("density 0" in w for w in result["warnings"])


# ---------------------------------------------------------------------------------------------------------------
# Several processes


@pytest.mark.slow
@pytest.mark.distributed
def test_two_processes_give_the_same_analysis(synthetic, tmp_path):
    base, agents, _ = synthetic
    single = ram_trl.analyze(base, agents, tmp_path / "p1", progress=False)
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    command += ["-m", "ram_trl", "analyze", "--base", str(base), *map(str, agents), "--out", str(tmp_path / "p2")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = run_job([*command, "--no-progress"], port, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.count("Task-vector sparsity") == 1  # rank 0 prints, rank 1 does not
    double = json.loads((tmp_path / "p2" / "analysis.json").read_text())
    assert double["processes"] == 2 and single["processes"] == 1
    assert_same_analysis(double, single)
    for name in ("density.png", "overlap.png", "anatomy.png", "magnitude.png", "analysis.md"):
        assert (tmp_path / "p2" / name).stat().st_size > 1_000, name
