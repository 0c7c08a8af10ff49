"""The ``ram-trl`` command line: in-process through ``ram_trl.cli.main`` and once as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.cli import main
from tests.helpers import ALL_METHODS, config_for, failing_writer, leftovers, load_checkpoint, snapshot

OUTPUT_FILES = {"model.safetensors", "README.md", "ram_merge_report.json", "config.json"}


def write_config(path: Path, config: dict) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


@pytest.fixture
def config_path(ckpts, tmp_path) -> Path:
    return write_config(tmp_path / "merge.yaml", config_for(ckpts, "ram_plus", parameters={"r": 0.2}))


def assert_nothing_written(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert leftovers(out) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inputs", "merge.yaml"]


def test_merge(ckpts, config_path, tmp_path, capsys):
    out = tmp_path / "merged"
    before = snapshot(ckpts.root)
    assert main(["merge", str(config_path), str(out), "--no-progress"]) == 0
    assert {p.name for p in out.iterdir()} >= OUTPUT_FILES
    assert leftovers(out) == []
    assert snapshot(ckpts.root) == before

    report = json.loads((out / "ram_merge_report.json").read_text())
    assert report["merge_method"] == "ram_plus"
    assert report["parameters"]["r"] == 0.2
    assert [a["path"] for a in report["agents"]] == [str(a) for a in ckpts.agents]
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 16
    assert "ram_plus" in (out / "README.md").read_text()

    # same result as the Python API
    api = tmp_path / "api"
    ram_trl.merge(config_path, api, progress=False)
    got, want = load_checkpoint(out), load_checkpoint(api)
    assert set(got) == set(ckpts.base_tensors)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert "error" not in capsys.readouterr().err


def test_merge_sharded_output(ckpts, config_path, tmp_path):
    out = tmp_path / "merged"
    assert main(["merge", str(config_path), str(out), "--max-shard-size", "1KB", "--no-progress"]) == 0
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(shards) >= 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert not (out / "model.safetensors").exists()
    assert {"README.md", "ram_merge_report.json", "config.json"} <= {p.name for p in out.iterdir()}

    index = json.loads((out / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    assert set(weight_map) == set(ckpts.base_tensors)
    assert set(weight_map.values()) == set(shards)
    data_bytes = 0
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as handle:
            names = set(handle.keys())
            assert names == {n for n, f in weight_map.items() if f == shard}
            for name in names:
                tensor = handle.get_tensor(name)
                data_bytes += tensor.numel() * tensor.element_size()
        assert (out / shard).stat().st_size <= 1000 + 1024  # data <= 1KB, plus the header
    assert index["metadata"]["total_size"] == data_bytes

    single = tmp_path / "single"
    assert main(["merge", str(config_path), str(single), "--no-progress"]) == 0
    want = load_file(str(single / "model.safetensors"))
    got = {}
    for shard in shards:
        got.update(load_file(str(out / shard)))
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_dry_run(ckpts, config_path, tmp_path, capsys):
    out = tmp_path / "merged"
    before = snapshot(ckpts.root)
    assert main(["merge", str(config_path), str(out), "--dry-run"]) == 0
    captured = capsys.readouterr()
    text = captured.out + captured.err
    for needle in ("bytes to read", "bytes to write", "peak memory", "dry run"):
        assert needle in text, f"{needle!r} not in the dry-run output:\n{text}"
    assert_nothing_written(tmp_path, out)
    assert snapshot(ckpts.root) == before


def _missing_config(ckpts, tmp_path):
    return tmp_path / "nope.yaml", []


def _corrupt_agent(ckpts, tmp_path):
    (ckpts.agents[1] / "model.safetensors").write_bytes(b"garbage" * 10)
    return tmp_path / "merge.yaml", []


def _unknown_method(ckpts, tmp_path):
    write_config(tmp_path / "merge.yaml", config_for(ckpts, "ram_pluss"))
    return tmp_path / "merge.yaml", []


def _bad_shard_size(ckpts, tmp_path):
    return tmp_path / "merge.yaml", ["--max-shard-size", "lots"]


def _bad_chunk_budget(ckpts, tmp_path):
    return tmp_path / "merge.yaml", ["--chunk-budget=-5MB"]


def _pickle_agent(ckpts, tmp_path):
    state = load_checkpoint(ckpts.agents[0])
    (ckpts.agents[0] / "model.safetensors").unlink()
    torch.save(state, ckpts.agents[0] / "pytorch_model.bin")
    return tmp_path / "merge.yaml", []


def _nonfinite_agent(ckpts, tmp_path):
    state = load_checkpoint(ckpts.agents[1])
    state["model.layers.0.mlp.up_proj.bias"][5] = float("nan")
    save_file(state, str(ckpts.agents[1] / "model.safetensors"), metadata={"format": "pt"})
    return tmp_path / "merge.yaml", []


@pytest.mark.parametrize(
    ("setup", "needle"),
    [
        (_missing_config, "nope.yaml"),
        (_corrupt_agent, "agent 1"),
        (_unknown_method, "ram_pluss"),
        (_bad_shard_size, "lots"),
        (_bad_chunk_budget, "-5MB"),
        (_pickle_agent, "--allow-pickle"),
        (_nonfinite_agent, "up_proj.bias"),
    ],
    ids=["missing_config", "corrupt_agent", "unknown_method", "bad_shard_size", "bad_chunk_budget", "pickle", "nan"],
)
def test_bad_input_exits_2(ckpts, config_path, tmp_path, capsys, setup, needle):
    path, flags = setup(ckpts, tmp_path)
    out = tmp_path / "merged"
    assert main(["merge", str(path), str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert "ram-trl merge: error: " in err
    assert needle in err
    assert "Traceback" not in err
    assert_nothing_written(tmp_path, out)


def test_output_exists_exits_2(config_path, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "keep.txt").write_text("keep me")
    assert main(["merge", str(config_path), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "ram-trl merge: error: " in err and "--overwrite" in err and "Traceback" not in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    # --overwrite replaces only a recognisable previous output, and says what it would have deleted
    assert main(["merge", str(config_path), str(out), "--no-progress", "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "not a previous ram_trl output" in err and "keep.txt" in err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    (out / "ram_merge_report.json").write_text("{}\n")
    assert main(["merge", str(config_path), str(out), "--no-progress", "--overwrite"]) == 0
    assert {p.name for p in out.iterdir()} >= OUTPUT_FILES
    assert not (out / "keep.txt").exists()
    assert leftovers(out) == []


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as info:
        main(["merge"])
    assert info.value.code == 2
    assert "error:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["frobnicate"])
    assert info.value.code == 2


def test_interrupted_merge_exits_130_and_leaves_nothing(ckpts, config_path, tmp_path, monkeypatch, capsys):
    failing_writer(monkeypatch, KeyboardInterrupt)
    out = tmp_path / "merged"
    try:
        code = main(["merge", str(config_path), str(out), "--no-progress"])
    except KeyboardInterrupt:  # pragma: no cover - a failure, but must not abort the test session
        pytest.fail("KeyboardInterrupt escaped ram_trl.cli.main")
    assert code == 130
    assert "interrupted" in capsys.readouterr().err
    assert_nothing_written(tmp_path, out)


def test_methods_lists_every_method(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name in ALL_METHODS:
        assert name in text


def test_methods_in_a_narrow_terminal(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    assert main(["methods"]) == 0
    text = capsys.readouterr().out
    for name in ALL_METHODS:
        assert name in text


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"ram-trl {ram_trl.__version__}"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ram_trl", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_subprocess_merge(ckpts, config_path, tmp_path):
    out = tmp_path / "merged"
    result = _run("merge", str(config_path), str(out), "--no-progress", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert {p.name for p in out.iterdir()} >= OUTPUT_FILES
    assert leftovers(out) == []
    assert set(load_checkpoint(out)) == set(ckpts.base_tensors)


@pytest.mark.parametrize("terminal", [False, True])
def test_a_log_file_gets_no_progress_bars(monkeypatch, terminal):
    """With stderr a log file, a command runs as with --no-progress and with transformers' bars off (put back
    after); in a terminal both stay on."""
    from transformers.utils import logging as hf_logging

    import ram_trl.cli as cli

    seen = {}

    def fake_fisher(args):
        seen["no_progress"] = args.no_progress
        seen["bars"] = hf_logging.is_progress_bar_enabled()
        return 0

    monkeypatch.setattr(cli, "_run_fisher", fake_fisher)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: terminal, raising=False)
    hf_logging.enable_progress_bar()
    assert main(["fisher", "agent", "--prompts", "prompts.txt"]) == 0
    assert seen == {"no_progress": not terminal, "bars": terminal}
    assert hf_logging.is_progress_bar_enabled()
