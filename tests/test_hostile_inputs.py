"""Hostile inputs and faults, through the command line as a user meets them (issue 12, defect classes 1-9).

Every refusal: exit code 2, one ``error:`` line naming the file / field / tensor / agent and what to change, no
traceback, no output and no temporary sibling left, the inputs unchanged.
"""

from __future__ import annotations

import errno
import json
import math
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.cli import main
from ram_trl.errors import OutputError
from ram_trl.io import safetensors_io
from ram_trl.merging import engine
from tests.helpers import (
    BIAS,
    DOWN,
    EMBED,
    HIDDEN,
    INTER,
    UP,
    VOCAB,
    Checkpoints,
    config_for,
    error_line,
    leftovers,
    load_checkpoint,
    make_checkpoints,
    save_checkpoint,
    snapshot,
)

# ---------------------------------------------------------------------------------------------------------------
# Helpers


@pytest.fixture
def ckpts(tmp_path) -> Checkpoints:
    return make_checkpoints(tmp_path / "inputs")


def write_config(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def refused_merge(capsys, tmp_path: Path, config: dict[str, Any], *needles: object, args=(), inputs=None) -> str:
    """``ram-trl merge`` must exit 2 naming every needle, write nothing and leave the inputs unchanged."""
    inputs = inputs or tmp_path / "inputs"
    before = snapshot(inputs)
    config_path = write_config(tmp_path / "merge.yaml", config)
    out = tmp_path / "out" / "merged"
    line = error_line(capsys, main(["merge", str(config_path), str(out), "--no-progress", *args]))
    for needle in needles:
        assert str(needle) in line, f"{needle!r} not in {line!r}"
    assert not out.exists() and not (tmp_path / "out").exists(), "output (or its parent) left behind"
    assert leftovers(out) == []
    assert snapshot(inputs) == before, "inputs were modified"
    return line


# ---------------------------------------------------------------------------------------------------------------
# 1. Non-finite or out-of-domain numbers


@pytest.mark.parametrize(
    ("method", "global_params", "agent_params", "needles"),
    [
        ("task_arithmetic", None, {"weight": math.nan}, ["models[0]", "'weight'", "finite"]),
        ("task_arithmetic", {"lambda": -math.inf}, None, ["'lambda'", "finite"]),
        ("task_arithmetic", None, {"weight": 1e39}, ["'weight'", "float32"]),
        ("ram_plus", {"r": math.inf}, None, ["parameters", "'r'", "finite"]),
        ("ram_plus", {"alpha": math.nan}, None, ["'alpha'", "finite"]),
        ("ram", {"eps": math.nan}, None, ["'eps'", "finite"]),
        ("ram", {"eps": -1.0}, None, ["'eps'", ">= 0"]),
        ("ties", None, {"density": math.nan}, ["'density'", "finite"]),
        ("dare_linear", {"density": math.inf}, None, ["'density'", "finite"]),
        (
            "task_arithmetic",
            None,
            {"weight": [{"filter": "up_proj", "value": math.nan}, {"value": 1.0}]},
            ["'weight'", "finite"],
        ),
        ("task_arithmetic", None, {"weight": [{"filter": 3, "value": 1.0}]}, ["filter", "substring"]),
        ("fisher", {"fisher_floor": math.inf}, None, ["'fisher_floor'", "finite"]),
    ],
)
def test_nonfinite_and_out_of_range_parameters(ckpts, tmp_path, capsys, method, global_params, agent_params, needles):
    config = config_for(ckpts, method, parameters=global_params, agent_parameters=agent_params)
    refused_merge(capsys, tmp_path, config, tmp_path / "merge.yaml", *needles)


def test_linear_weights_summing_to_zero(ckpts, tmp_path, capsys):
    config = config_for(ckpts, "linear")
    config["models"][0]["parameters"] = {"weight": 1.0}
    config["models"][1]["parameters"] = {"weight": [{"filter": "up_proj", "value": -1.0}, {"value": 1.0}]}
    refused_merge(capsys, tmp_path, config, "sum to 0", "up_proj", "normalize: false")


def test_huge_parameters_that_overflow_the_output_are_refused(ckpts, tmp_path, capsys):
    config = config_for(ckpts, "task_arithmetic", parameters={"lambda": 3e38}, agent_parameters={"weight": 3e38})
    refused_merge(capsys, tmp_path, config, "overflow", "use smaller values")


# ---------------------------------------------------------------------------------------------------------------
# 2. --overwrite never deletes an input, and only replaces a previous output


def _previous_output(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ram_merge_report.json").write_text("{}\n")


def test_overwrite_never_deletes_the_config_it_reads(ckpts, tmp_path, capsys):
    d = tmp_path / "d"
    _previous_output(d)
    config = write_config(d / "merge.yaml", config_for(ckpts))
    before = snapshot(d)
    line = error_line(capsys, main(["merge", str(config), str(d), "--overwrite", "--no-progress"]))
    assert "merge config" in line and str(config) in line
    assert snapshot(d) == before


def test_overwrite_never_deletes_a_fisher_file_it_reads(ckpts, tmp_path, capsys):
    out = tmp_path / "out"
    _previous_output(out)
    for i, agent in enumerate(ckpts.agents):
        fisher = {k: torch.ones_like(v) for k, v in load_checkpoint(agent).items()}
        save_file(fisher, str(out / f"fisher{i}.safetensors"))
    config = config_for(ckpts, "fisher")
    for i, entry in enumerate(config["models"]):
        entry["parameters"] = {"fisher": str(out / f"fisher{i}.safetensors")}
    config_path = write_config(tmp_path / "merge.yaml", config)
    before = snapshot(out)
    line = error_line(capsys, main(["merge", str(config_path), str(out), "--overwrite", "--no-progress"]))
    assert "Fisher file of agent 0" in line
    assert snapshot(out) == before


def test_overwrite_refuses_a_directory_that_is_not_a_previous_output(ckpts, tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    config = write_config(tmp_path / "merge.yaml", config_for(ckpts))
    line = error_line(capsys, main(["merge", str(config), str(home), "--overwrite", "--no-progress"]))
    assert "would delete: notes.txt" in line
    assert (home / "notes.txt").read_text() == "mine"


# ---------------------------------------------------------------------------------------------------------------
# 3. A concurrent run's output is never replaced


def test_an_output_that_appears_during_the_merge_is_not_replaced(ckpts, tmp_path, monkeypatch):
    out = tmp_path / "merged"
    original = engine.finalize_output

    def finalize_then_race(*args, **kwargs):
        original(*args, **kwargs)
        out.mkdir()
        (out / "other_run.txt").write_text("the other run's output")

    monkeypatch.setattr(engine, "finalize_output", finalize_then_race)
    with pytest.raises(OutputError, match="appeared while this run was writing"):
        ram_trl.merge(config_for(ckpts), out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["other_run.txt"]
    assert leftovers(out) == []


# ---------------------------------------------------------------------------------------------------------------
# 4. Index files cannot pull weights from outside the checkpoint directory


def _index_agent(ckpts: Checkpoints, tmp_path: Path, shard_path: str | None = None) -> Path:
    """Agent 1 as an index pointing at its single file placed elsewhere (``shard_path`` relative to the agent)."""
    agent = ckpts.agents[1]
    outside = tmp_path / "elsewhere" / "weights.safetensors"
    outside.parent.mkdir()
    (agent / "model.safetensors").rename(outside)
    name = shard_path if shard_path is not None else str(outside)
    weight_map = dict.fromkeys(ckpts.base_tensors, name)
    (agent / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return agent


@pytest.mark.parametrize("how", ["absolute", "dotdot", "symlink"])
def test_index_paths_outside_the_checkpoint_are_refused(ckpts, tmp_path, capsys, how):
    if how == "symlink":
        agent = _index_agent(ckpts, tmp_path, "link.safetensors")
        (agent / "link.safetensors").symlink_to(tmp_path / "elsewhere" / "weights.safetensors")
    else:
        agent = _index_agent(ckpts, tmp_path, None if how == "absolute" else "../../elsewhere/weights.safetensors")
    refused_merge(
        capsys, tmp_path, config_for(ckpts), "agent 1", "outside the checkpoint directory", "--allow-external-shards"
    )
    config = write_config(tmp_path / "merge.yaml", config_for(ckpts))
    assert main(["merge", str(config), str(tmp_path / "ok"), "--no-progress", "--allow-external-shards"]) == 0


def test_an_index_naming_a_system_file_never_opens_it(ckpts, tmp_path, capsys, monkeypatch):
    agent = ckpts.agents[1]
    (agent / "model.safetensors").unlink()  # the index is the agent's only weight source (both would be refused)
    weight_map = dict.fromkeys(ckpts.base_tensors, "/etc/passwd")
    (agent / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    opened = []
    real_read = safetensors_io.read_safetensors_header
    monkeypatch.setattr(
        "ram_trl.io.checkpoint.read_safetensors_header", lambda path: opened.append(path) or real_read(path)
    )
    refused_merge(capsys, tmp_path, config_for(ckpts), "/etc/passwd", "outside the checkpoint directory")
    assert Path("/etc/passwd") not in opened


def test_pickle_index_paths_outside_the_checkpoint_are_refused(ckpts, tmp_path, capsys):
    agent = ckpts.agents[1]
    torch.save(load_checkpoint(agent), tmp_path / "outside.bin")
    (agent / "model.safetensors").unlink()
    weight_map = dict.fromkeys(ckpts.base_tensors, "../../outside.bin")
    (agent / "pytorch_model.bin.index.json").write_text(json.dumps({"weight_map": weight_map}))
    refused_merge(capsys, tmp_path, config_for(ckpts), "outside the checkpoint directory", args=["--allow-pickle"])


# ---------------------------------------------------------------------------------------------------------------
# 5. merge_common_rows resizes vocabulary tensors only


def test_merge_common_rows_refuses_a_truncated_projection(ckpts, tmp_path, capsys):
    tensors = load_checkpoint(ckpts.agents[1])
    tensors[UP] = tensors[UP][: INTER // 2].clone()
    (ckpts.agents[1] / "model.safetensors").unlink()
    save_file(tensors, str(ckpts.agents[1] / "model.safetensors"))
    config = config_for(ckpts, shape_mismatch="merge_common_rows")
    refused_merge(capsys, tmp_path, config, "agent 1", UP, f"[{INTER // 2}, {HIDDEN}]", "vocabulary tensors")


def _adapter(path: Path, factors: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 2, **(config or {})})
    )
    save_file(factors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path


def _up_factors(rows: int = INTER, value: float = 0.01) -> dict[str, torch.Tensor]:
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    return {
        f"{prefix}.lora_A.weight": torch.full((2, HIDDEN), value),
        f"{prefix}.lora_B.weight": torch.full((rows, 2), value),
    }


def test_merge_common_rows_refuses_a_lora_factor_with_missing_rows(ckpts, tmp_path, capsys):
    adapter = _adapter(ckpts.root / "lora", _up_factors(rows=INTER // 2))
    config = config_for(ckpts, agents=[ckpts.agents[0], adapter], shape_mismatch="merge_common_rows")
    refused_merge(capsys, tmp_path, config, "agent 1", UP, "LoRA delta", "vocabulary tensors")


# ---------------------------------------------------------------------------------------------------------------
# 7. Malformed files: one error line, never a traceback


def _rewrite_header(file: Path, mutate) -> None:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    mutate(header)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data[8 + length :])


def _set(name: str, key: str, value: Any):
    def mutate(header: dict[str, Any]) -> None:
        header[name][key] = value

    return mutate


def _metadata_list(header: dict[str, Any]) -> None:
    header["__metadata__"] = ["format", "pt"]


def _overlap(header: dict[str, Any]) -> None:
    first, second = header[DOWN]["data_offsets"], header[UP]["data_offsets"]
    size = first[1] - first[0]
    header[DOWN]["data_offsets"] = [second[0], second[0] + size]  # same bytes as UP's


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (_set(UP, "dtype", ["F32"]), "dtype must be a string"),
        (_metadata_list, "__metadata__"),
        (_set(BIAS, "shape", [-INTER]), "non-negative integers"),
        (_set(BIAS, "shape", ["24"]), "non-negative integers"),
        (_set(BIAS, "shape", [True]), "non-negative integers"),
        (_set(BIAS, "data_offsets", "0-96"), "data_offsets"),
        (_set(BIAS, "data_offsets", [0, 96, 192]), "data_offsets"),
        (_set(BIAS, "data_offsets", [-96, 0]), "data_offsets"),
        (_set(BIAS, "data_offsets", [0, 10**30]), "spans"),
        (_overlap, "overlap"),
    ],
    ids=[
        "dtype_list",
        "metadata_list",
        "negative_shape",
        "string_shape",
        "bool_shape",
        "offsets_string",
        "offsets_three",
        "offsets_negative",
        "offsets_huge",
        "offsets_overlap",
    ],
)
def test_malformed_safetensors_headers(ckpts, tmp_path, capsys, mutate, needle):
    file = ckpts.agents[1] / "model.safetensors"
    _rewrite_header(file, mutate)
    refused_merge(capsys, tmp_path, config_for(ckpts), "agent 1", file, needle)


@pytest.mark.parametrize(
    ("index", "needle"),
    [
        ({"weight_map": ["model.safetensors"]}, "'weight_map' must be an object"),
        ({"weight_map": {EMBED: 3}}, "must be a shard file name"),
        ({"weight_map": {EMBED: ""}}, "must be a shard file name"),
        ([1, 2], "must hold a JSON object"),
        ({}, "'weight_map' must be an object"),
    ],
)
def test_malformed_index_files(ckpts, tmp_path, capsys, index, needle):
    (ckpts.agents[1] / "model.safetensors").unlink()  # the index alone, so that its own fault is the one named
    (ckpts.agents[1] / "model.safetensors.index.json").write_text(json.dumps(index))
    refused_merge(capsys, tmp_path, config_for(ckpts), "agent 1", "index", needle)


@pytest.mark.parametrize(
    ("adapter_config", "needle"),
    [
        ({"r": 0}, "'r'"),
        ({"r": "eight"}, "positive integer rank"),
        ({"r": 2.5}, "positive integer rank"),
        ({"lora_alpha": math.nan}, "lora_alpha must be a finite number"),
        ({"lora_alpha": "x"}, "lora_alpha must be a finite number"),
        ({"rank_pattern": {"up_proj(": 2}}, "not a valid regular expression"),
        ({"alpha_pattern": {"[": 2}}, "not a valid regular expression"),
        ({"rank_pattern": ["up_proj"]}, "rank_pattern must be an object"),
        ({"rank_pattern": {"up_proj": 0}}, "positive integer rank"),
    ],
)
def test_malformed_adapter_configs(ckpts, tmp_path, capsys, adapter_config, needle):
    adapter = _adapter(ckpts.root / "lora", _up_factors(), adapter_config)
    config = config_for(ckpts, agents=[ckpts.agents[0], adapter])
    refused_merge(capsys, tmp_path, config, "agent 1", "adapter_config.json", needle.replace("'r'", "r must be"))


@pytest.mark.parametrize("bad", [math.nan, math.inf])
@pytest.mark.parametrize("method", ["task_arithmetic", "ram_plus", "ties"])
def test_nonfinite_lora_factors_are_named(ckpts, tmp_path, capsys, bad, method):
    factors = _up_factors()
    factors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"][3, 1] = bad
    adapter = _adapter(ckpts.root / "lora", factors)
    config = config_for(ckpts, method, agents=[ckpts.agents[0], adapter])
    refused_merge(capsys, tmp_path, config, "agent 1", UP, "LoRA delta", "NaN/Inf")


@pytest.mark.parametrize("content", [{"x": 1}, [torch.zeros(2)], {"x": "text"}])
def test_pickles_holding_non_tensors(ckpts, tmp_path, capsys, content):
    (ckpts.agents[1] / "model.safetensors").unlink()
    torch.save(content, ckpts.agents[1] / "pytorch_model.bin")
    refused_merge(capsys, tmp_path, config_for(ckpts), "agent 1", "pytorch_model.bin", args=["--allow-pickle"])


@pytest.mark.parametrize("device", ["gpu", "cuda:99", "tpu", "cpu:x"])
def test_unknown_devices(ckpts, tmp_path, capsys, device):
    refused_merge(capsys, tmp_path, config_for(ckpts), "--device", device, args=["--device", device])


@pytest.mark.parametrize("value", ["inf", "nan", "-1"])
def test_analyze_refuses_non_finite_r(ckpts, tmp_path, capsys, value):
    out = tmp_path / "analysis"
    argv = ["analyze", "--base", str(ckpts.base), *map(str, ckpts.agents), "--out", str(out), "--r", value]
    line = error_line(capsys, main([*argv, "--no-progress", "--no-figures"]))
    assert "--r" in line
    assert not out.exists()


@pytest.mark.parametrize(
    ("content", "needle"),
    [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), (json.dumps({"vocab_size": "x"}), "vocab_size")],
)
def test_invalid_base_config_json_is_refused_before_any_tensor_is_read(
    ckpts, tmp_path, capsys, monkeypatch, content, needle
):
    (ckpts.base / "config.json").write_text(content)

    def no_reads(*args, **kwargs):
        raise AssertionError("a tensor was read before the base config.json was checked")

    monkeypatch.setattr(safetensors_io.RowReader, "read_rows", no_reads)
    refused_merge(capsys, tmp_path, config_for(ckpts), "base model", "config.json", needle)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_full_or_read_only_output_file_system(ckpts, tmp_path, capsys, monkeypatch, code):
    def fail(self, *args, **kwargs):
        raise OSError(code, "simulated", str(self.path))

    monkeypatch.setattr(safetensors_io.ShardFile, "write_rows", fail)
    line = refused_merge(capsys, tmp_path, config_for(ckpts), "cannot write output directory")
    assert ("space" in line) if code == errno.ENOSPC else ("read-only" in line)


# ---------------------------------------------------------------------------------------------------------------
# 8. Smaller ones


def test_a_delta_that_overflows_float32_is_refused(tmp_path, capsys):
    def extreme(sign: float):
        def change(tensors):
            tensors = dict(tensors)
            tensors[UP] = tensors[UP].clone()
            tensors[UP][0, 0] = sign * 3e38
            return tensors

        return change

    base = make_checkpoints(tmp_path / "inputs", 1)
    # the base holds -3e38 where agent 0 holds +3e38: both finite, their difference is not
    save_checkpoint(tmp_path / "inputs" / "base2", extreme(-1.0)(base.base_tensors))
    save_checkpoint(tmp_path / "inputs" / "agent_far", extreme(1.0)(base.agent_tensors[0]))
    config = config_for(base, agents=[tmp_path / "inputs" / "agent_far"])
    config["base_model"] = str(tmp_path / "inputs" / "base2")
    refused_merge(capsys, tmp_path, config, "agent 0", UP, "overflows float32")


def test_fisher_refuses_pickle_only_agents(ckpts, tmp_path, capsys):
    agent = ckpts.agents[0]
    torch.save(load_checkpoint(agent), agent / "pytorch_model.bin")
    (agent / "model.safetensors").unlink()
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("1+1=\n")
    line = error_line(capsys, main(["fisher", str(agent), "--prompts", str(prompts), "--no-progress"]))
    assert str(agent) in line and "--allow-pickle" in line
    assert not (agent / "fisher.safetensors").exists()


def test_a_failed_analysis_leaves_nothing(ckpts, tmp_path, capsys, monkeypatch):
    from ram_trl.analysis import plots

    def broken(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(plots, "write_figures", broken)
    out = tmp_path / "a" / "analysis"
    argv = ["analyze", "--base", str(ckpts.base), *map(str, ckpts.agents), "--out", str(out), "--no-progress"]
    line = error_line(capsys, main(argv))
    assert "space" in line
    assert not (tmp_path / "a").exists()


def test_a_failed_merge_leaves_no_empty_parent_directories(tmp_path):
    def poison(tensors):
        tensors = dict(tensors)
        tensors[DOWN] = tensors[DOWN].clone()
        tensors[DOWN][1, 1] = math.nan
        return tensors

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: poison})
    with pytest.raises(ram_trl.errors.NonFiniteError):
        ram_trl.merge(config_for(ckpts), tmp_path / "a" / "b" / "merged", progress=False)
    assert not (tmp_path / "a").exists()


# ---------------------------------------------------------------------------------------------------------------
# 9. Fidelity


@pytest.mark.parametrize("method", ["ram", "ram_plus", "task_arithmetic", "ties", "linear"])
def test_negative_zero_base_elements_are_copied_bit_for_bit(tmp_path, method):
    def negative_zero(tensors):
        tensors = dict(tensors)
        tensors[UP] = tensors[UP].clone()
        tensors[UP][2, :] = -0.0
        return tensors

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={0: negative_zero, 1: negative_zero})
    save_checkpoint(tmp_path / "inputs" / "base_nz", negative_zero(ckpts.base_tensors))
    config = config_for(ckpts, method)
    config["base_model"] = str(tmp_path / "inputs" / "base_nz")
    ram_trl.merge(config, tmp_path / "merged", progress=False)
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))[UP]
    assert torch.equal(merged[2], torch.zeros(HIDDEN)) and bool(torch.signbit(merged[2]).all())


def test_mergekit_linear_yaml_without_base_model(ckpts, tmp_path):
    config = {
        "merge_method": "linear",
        "models": [{"model": str(a), "parameters": {"weight": 1.0}} for a in ckpts.agents],
    }
    config_path = write_config(tmp_path / "linear.yaml", config)
    assert main(["merge", str(config_path), str(tmp_path / "merged"), "--no-progress"]) == 0
    merged = load_checkpoint(tmp_path / "merged")
    for name, value in merged.items():
        expected = (ckpts.agent_tensors[0][name] + ckpts.agent_tensors[1][name]) / 2
        torch.testing.assert_close(value, expected, rtol=0, atol=1e-6)
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["vocab_size"] == VOCAB
    # the lock file never reaches a committed output
    assert not (tmp_path / "merged" / ".ram-trl-lock").exists()


def test_other_methods_still_need_a_base_model(ckpts, tmp_path, capsys):
    config = {"merge_method": "ties", "models": [{"model": str(a)} for a in ckpts.agents]}
    refused_merge(capsys, tmp_path, config, "base_model is missing")


# ---------------------------------------------------------------------------------------------------------------
# Manifests and prompt files


@pytest.mark.parametrize(
    "manifest", [{"schema_version": "two"}, {"schema_version": [1]}, [1, 2], "text", {"schema_version": None}]
)
def test_malformed_stage_manifests(ckpts, tmp_path, capsys, manifest):
    stage = ckpts.root / "stage"
    stage.mkdir()
    (stage / "ram_stage.json").write_text(json.dumps(manifest))
    config = config_for(ckpts)
    config["models"][1] = {"stage": str(stage)}
    refused_merge(capsys, tmp_path, config, "stage manifest", "ram_stage.json")


def test_a_binary_prompts_file(ckpts, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"\xff\xfe\x00binary")
    line = error_line(capsys, main(["fisher", str(ckpts.agents[0]), "--prompts", str(prompts), "--no-progress"]))
    assert str(prompts) in line and "UTF-8" in line


def test_example_overwrite_only_replaces_an_earlier_example(tmp_path, capsys):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    line = error_line(capsys, main(["example", str(home), "--overwrite"]))
    assert "would delete: notes.txt" in line and (home / "notes.txt").read_text() == "mine"
    root = tmp_path / "example"
    assert main(["example", str(root)]) == 0
    assert main(["example", str(root), "--overwrite"]) == 0
    config = yaml.safe_load((root / "merge.yaml").read_text())
    assert config["base_model"] == str((root / "base").resolve())
    assert all(Path(m["model"]).parent == root.resolve() for m in config["models"])
    assert leftovers(root) == []
