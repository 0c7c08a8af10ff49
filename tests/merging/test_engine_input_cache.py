"""The merge's input cache (``input_cache``): with a statistics pass (RAM+, RAM+s) the chunks that pass read are kept
for the merge pass, which neither reads nor copies them again; the output is the same bytes with or without it,
whatever its budget."""

from __future__ import annotations

import json

import pytest

import ram_trl
from ram_trl.cli import main
from ram_trl.errors import ConfigError
from tests.fake_cuda import fake_cuda_device
from tests.helpers import config_for, lora_adapter, make_checkpoints, qwen_model, save_base


def _bytes(directory) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.glob("*.safetensors"))}


def _merge(config, out, **options):
    return ram_trl.merge(config, out, progress=False, chunk_budget="4KB", **options)


@pytest.mark.parametrize("method", ["ram_plus", "ram_plus_soft"])
def test_the_cache_changes_what_is_read_not_what_is_written(tmp_path, method):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=3, fraction=0.4)
    config = config_for(ckpts, method)
    off = _merge(config, tmp_path / "off", input_cache="off")
    whole = _merge(config, tmp_path / "whole", input_cache="1GB")
    assert off["input_cache"] is None
    kept = whole["input_cache"]
    assert kept["kept_chunks"] > 10 and kept["taken_chunks"] == kept["kept_chunks"]
    # full checkpoints: what is kept is exactly what the merge pass no longer reads
    assert off["bytes_read"] - whole["bytes_read"] == kept["kept_bytes"]
    assert _bytes(tmp_path / "whole") == _bytes(tmp_path / "off")
    assert _bytes(tmp_path / "off")


def test_a_cache_smaller_than_the_inputs_keeps_the_first_chunks(tmp_path):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=3, fraction=0.4)
    config = config_for(ckpts, "ram_plus")
    off = _merge(config, tmp_path / "off", input_cache="off")
    part = _merge(config, tmp_path / "part", input_cache=6000)
    kept = part["input_cache"]
    assert 0 < kept["kept_bytes"] <= 6000 and kept["taken_chunks"] == kept["kept_chunks"]
    assert off["bytes_read"] - part["bytes_read"] == kept["kept_bytes"]
    assert _bytes(tmp_path / "part") == _bytes(tmp_path / "off")


def test_a_lora_agent_merges_the_same_from_the_cache(tmp_path):
    base_dir = save_base(qwen_model(), tmp_path / "base")
    lora_adapter(qwen_model(), tmp_path / "adapter", r=4, target_modules=["q_proj", "down_proj"])
    lora_adapter(qwen_model(), tmp_path / "other", seed=2, r=2, target_modules=["v_proj", "up_proj"])
    config = {
        "merge_method": "ram_plus",
        "base_model": str(base_dir),
        "models": [{"model": str(tmp_path / "adapter")}, {"model": str(tmp_path / "other")}],
    }
    _merge(config, tmp_path / "off", input_cache="off")
    report = _merge(config, tmp_path / "cached", input_cache="1GB")
    assert report["input_cache"]["taken_chunks"] > 0
    assert _bytes(tmp_path / "cached") == _bytes(tmp_path / "off")


@pytest.mark.parametrize("method", ["ram_plus", "ties"])
def test_auto_keeps_nothing_on_the_cpu_and_nothing_without_a_statistics_pass(tmp_path, method):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=2)
    report = _merge(config_for(ckpts, method), tmp_path / "out")
    assert report["input_cache"] is None
    if method == "ties":  # no statistics pass: a size changes nothing either
        report = _merge(config_for(ckpts, method), tmp_path / "sized", input_cache="1GB")
        assert report["input_cache"] is None


def test_auto_on_an_accelerator_keeps_the_inputs_there(tmp_path, monkeypatch):
    """On the (fake) CUDA device, ``auto`` keeps every chunk (half of the device's free memory is plenty), on the
    device, and the output is the CPU merge's bytes."""
    ckpts = make_checkpoints(tmp_path / "in", num_agents=3, fraction=0.4)
    config = config_for(ckpts, "ram_plus")
    off = _merge(config, tmp_path / "cpu")
    with fake_cuda_device(monkeypatch):
        report = _merge(config, tmp_path / "cuda", device="cuda")
    kept = report["input_cache"]
    assert kept["budget"] == 32 * 2**30  # half of the fake device's 64 GiB free
    assert kept["taken_chunks"] == kept["kept_chunks"] > 10
    assert off["bytes_read"] - report["bytes_read"] == kept["kept_bytes"]
    assert _bytes(tmp_path / "cuda") == _bytes(tmp_path / "cpu")


@pytest.mark.parametrize("setting", ["lots", -3, "0.5KB extra"])
def test_a_bad_setting_is_refused_before_anything_is_read(tmp_path, setting):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=2)
    with pytest.raises(ConfigError, match="--input-cache .*auto, off or a size"):
        _merge(config_for(ckpts, "ram_plus"), tmp_path / "out", input_cache=setting)
    assert not (tmp_path / "out").exists()


def test_the_command_line_flag(tmp_path, capsys):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=2, fraction=0.4)
    config = tmp_path / "merge.yaml"
    config.write_text(json.dumps(config_for(ckpts, "ram_plus")))
    assert main(["merge", str(config), str(tmp_path / "out"), "--input-cache", "64MB", "--no-progress"]) == 0
    report = json.loads((tmp_path / "out" / "ram_merge_report.json").read_text())
    assert report["input_cache"]["budget"] == 64_000_000 and report["input_cache"]["kept_chunks"] > 0
    assert main(["merge", str(config), str(tmp_path / "bad"), "--input-cache", "most"]) != 0
    assert "--input-cache 'most'" in capsys.readouterr().err
