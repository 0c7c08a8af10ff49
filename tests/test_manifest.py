"""Stage manifests (``ram_stage.json``): schema, atomic writes, base fingerprints, and ``models: [{stage: ...}]``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.errors import ConfigError
from ram_trl.manifest import (
    MANIFEST_NAME,
    StageManifest,
    check_base,
    fingerprint_checkpoint,
    fingerprint_names,
    fingerprint_state,
    read_manifest,
    write_manifest,
)
from tests.helpers import config_for, make_checkpoints


def stage_for(ckpts, t: int, **fields) -> Path:
    """Write a manifest for agent ``t`` in a stage directory beside it; returns the directory."""
    directory = ckpts.root / f"stage{t}"
    manifest = StageManifest(
        stage=f"vertical{t}",
        domain=["coding", "tools", "memory"][t],
        base_model=str(ckpts.base),
        base_fingerprint=fingerprint_checkpoint(ckpts.base),
        checkpoint=str(Path("..") / ckpts.agents[t].name),
        trainer="GRPOTrainer",
        steps=12,
        save_dtype="bfloat16",
        rewards={"reward": 0.5 + t},
        **fields,
    )
    write_manifest(manifest, directory)
    return directory


def test_fingerprint_names_spread_over_sorted_names():
    assert fingerprint_names(["c", "a", "b"]) == ["a", "b", "c"]
    names = [f"t{i:02d}" for i in range(10)]
    assert fingerprint_names(names, count=4) == ["t00", "t03", "t06", "t09"]


def test_fingerprint_is_dtype_independent_and_value_sensitive(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    on_disk = fingerprint_checkpoint(ckpts.base)
    as_float32 = {n: t.float() for n, t in ckpts.base_tensors.items()}
    assert fingerprint_state(as_float32, on_disk.tensors) == on_disk
    changed = dict(as_float32)
    name = on_disk.tensors[0]
    changed[name] = changed[name].clone()
    changed[name].reshape(-1)[0] += 1.0
    assert fingerprint_state(changed, on_disk.tensors).sha256 != on_disk.sha256


def test_manifest_round_trip_and_atomic_write(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    directory = stage_for(ckpts, 0)
    assert sorted(p.name for p in directory.iterdir()) == [MANIFEST_NAME]
    manifest = read_manifest(directory)
    assert manifest.stage == "vertical0" and manifest.steps == 12 and manifest.kind == "full"
    assert read_manifest(directory / MANIFEST_NAME) == manifest
    check_base(manifest, directory, ckpts.base)


def test_merge_from_stage_manifests_equals_merge_from_paths(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    stages = [stage_for(ckpts, t) for t in range(2)]
    by_path = config_for(ckpts, "ram_plus")
    by_stage = dict(by_path, models=[{"stage": str(s)} for s in stages])
    ram_trl.merge(by_path, tmp_path / "by_path", progress=False)
    report = ram_trl.merge(by_stage, tmp_path / "by_stage", progress=False)
    assert [a["name"] for a in report["agents"]] == ["vertical0", "vertical1"]
    assert report["agents"][1]["stage"]["domain"] == "tools"
    assert report["agents"][1]["stage"]["rewards"] == {"reward": 1.5}
    a = load_file(tmp_path / "by_path" / "model.safetensors")
    b = load_file(tmp_path / "by_stage" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    card = (tmp_path / "by_stage" / "README.md").read_text()
    assert "## Stages" in card and "vertical1" in card and "GRPOTrainer" in card
    saved = json.loads((tmp_path / "by_stage" / "ram_merge_report.json").read_text())
    assert saved["agents"][0]["stage"]["manifest"].endswith(MANIFEST_NAME)


def test_stage_of_another_base_is_refused_before_any_output(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    stage = stage_for(ckpts, 0)
    other = tmp_path / "other_base"
    other.mkdir()
    tensors = {n: t.clone() for n, t in ckpts.base_tensors.items()}
    name = read_manifest(stage).base_fingerprint.tensors[-1]
    tensors[name].reshape(-1)[0] += 1
    save_file(tensors, other / "model.safetensors")
    config = dict(config_for(ckpts, "ram"), base_model=str(other), models=[{"stage": str(stage)}])
    with pytest.raises(
        ConfigError, match=r"stage 'vertical0' .* not from the merge's base .*fingerprints differ"
    ):
        ram_trl.merge(config, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"stage": "missing_dir"}, "does not exist"),
        ({"model": "x", "stage": "y"}, "exactly one of"),
        ({"parameters": {}}, "exactly one of"),
    ],
)
def test_bad_stage_entries(tmp_path, entry, message):
    ckpts = make_checkpoints(tmp_path)
    config = dict(config_for(ckpts, "ram"), models=[entry])
    with pytest.raises(ConfigError, match=message):
        ram_trl.merge(config, tmp_path / "out", progress=False)


def test_bad_manifests_name_the_file(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ConfigError, match=rf"{MANIFEST_NAME}: not valid JSON"):
        read_manifest(bad)
    (bad / MANIFEST_NAME).write_text(json.dumps({"stage": "s", "base_model": "b"}))
    with pytest.raises(ConfigError, match="checkpoint: Field required"):
        read_manifest(bad)
    (bad / MANIFEST_NAME).write_text(json.dumps({"schema_version": 99, "stage": "s"}))
    with pytest.raises(ConfigError, match="newer than this ram_trl"):
        read_manifest(bad)


def test_analyze_accepts_stage_manifests_and_finds_their_base(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    stages = [stage_for(ckpts, t) for t in range(2)]
    by_path = ram_trl.analyze(ckpts.base, ckpts.agents, None, progress=False)
    by_stage = ram_trl.analyze(None, stages, None, progress=False)
    assert [a["name"] for a in by_stage["agents"]] == ["vertical0", "vertical1"]
    for a, b in zip(by_path["agents"], by_stage["agents"], strict=True):
        assert (a["active"], a["unique"], a["shared"], a["density"]) == (
            b["active"],
            b["unique"],
            b["shared"],
            b["density"],
        )
    with pytest.raises(ConfigError, match="the base may be left out only"):
        ram_trl.analyze(None, [ckpts.agents[0]], None, progress=False)
