"""Stage manifests (``ram_stage.json``): schema, atomic writes, base fingerprints, and ``models: [{stage: ...}]``."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.errors import ConfigError
from ram_trl.stage.manifest import (
    MANIFEST_NAME,
    StageManifest,
    check_base,
    describe_files,
    fingerprint,
    fingerprint_checkpoint,
    fingerprint_names,
    read_manifest,
    write_manifest,
)
from tests.helpers import config_for, make_checkpoints


def stage_for(ckpts, t: int, **fields) -> Path:
    """A stage directory holding a copy of agent ``t`` and its manifest (the files and their digests); returns
    the directory."""
    directory = ckpts.root / f"stage{t}"
    shutil.copytree(ckpts.agents[t], directory)
    fields.setdefault("files", describe_files(directory))
    fields.setdefault("base_fingerprint", fingerprint_checkpoint(ckpts.base))
    manifest = StageManifest(
        stage=f"vertical{t}",
        domain=["coding", "tools", "memory"][t],
        checkpoint=".",
        trainer="GRPOTrainer",
        steps=12,
        save_dtype="bfloat16",
        **{"rewards": {"reward": 0.5 + t}, "base_model": str(ckpts.base), **fields},
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
    assert fingerprint(as_float32.__getitem__, on_disk.tensors) == on_disk
    changed = dict(as_float32)
    name = on_disk.tensors[0]
    changed[name] = changed[name].clone()
    changed[name].reshape(-1)[0] += 1.0
    assert fingerprint(changed.__getitem__, on_disk.tensors).sha256 != on_disk.sha256


def test_manifest_round_trip_and_atomic_write(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    directory = stage_for(ckpts, 0)
    assert MANIFEST_NAME in {p.name for p in directory.iterdir()}
    manifest = read_manifest(directory)
    assert manifest.stage == "vertical0" and manifest.steps == 12 and manifest.kind == "full"
    assert read_manifest(directory / MANIFEST_NAME) == manifest
    check_base(manifest, directory, ckpts.base)


def test_stage_without_a_fingerprint_naming_another_base_is_warned_about(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    directory = stage_for(ckpts, 0, base_fingerprint=None, base_model=str(tmp_path / "elsewhere"))
    manifest = read_manifest(directory)
    with pytest.warns(UserWarning, match=r"stage 'vertical0' \(.*ram_stage.json\) has no base fingerprint"):
        check_base(manifest, directory, ckpts.base)
    same = read_manifest(stage_for(ckpts, 1, base_fingerprint=None))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_base(same, ckpts.root / "stage1", ckpts.base)


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
    with pytest.raises(ConfigError, match=r"stage 'vertical0' .* not from the merge's base .*fingerprints differ"):
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
    with pytest.raises(ConfigError, match="checkpoint is missing; add it"):
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


# ---------------------------------------------------------------------------------------------------------------
# The stage contract: the manifest names exactly its weight files, with their digests and its kind


def _merge_stage(ckpts, tmp_path, stage: Path, **options) -> dict:
    config = dict(config_for(ckpts, "ram_plus"), models=[{"stage": str(stage)}, {"model": str(ckpts.agents[1])}])
    return ram_trl.merge(config, tmp_path / "out", progress=False, **options)


def test_a_stage_written_over_after_its_save_is_refused_naming_the_file(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    stage = stage_for(ckpts, 0)
    tensors = load_file(stage / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1  # e.g. trainer.save_model into the stage's directory
    save_file(tensors, stage / "model.safetensors")
    with pytest.raises(ConfigError, match=r"model\.safetensors no longer matches the manifest's SHA-256") as exc:
        _merge_stage(ckpts, tmp_path, stage)
    assert "\n" not in str(exc.value) and str(stage / "model.safetensors") in str(exc.value)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("adapter", r"adapter_config\.json is not one of the files the manifest describes"),
        ("missing", r"model\.safetensors is missing \(the manifest names it\)"),
        ("no_agent", "describes no saved agent"),
        ("legacy_kind", "kind 'lora' but .*model.safetensors holds a full model's weights"),
    ],
)
def test_a_stage_whose_files_contradict_its_manifest_is_refused(tmp_path, change, message):
    ckpts = make_checkpoints(tmp_path)
    fields = {"no_agent": {"files": {}}, "legacy_kind": {"files": None, "kind": "lora"}}.get(change, {})
    stage = stage_for(ckpts, 0, **fields)
    if change == "adapter":
        (stage / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 1, "lora_alpha": 1}')
    if change == "missing":
        (stage / "model.safetensors").unlink()
    with pytest.raises(ConfigError, match=message):
        _merge_stage(ckpts, tmp_path, stage)
    with pytest.raises(ConfigError, match=message):
        ram_trl.analyze(ckpts.base, [stage, ckpts.agents[1]], None, progress=False)


def test_a_checkpoint_outside_the_manifest_directory_is_refused_unless_allowed(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    directory = tmp_path / "elsewhere"
    manifest = StageManifest(
        stage="outside",
        base_model=str(ckpts.base),
        checkpoint=str(Path("..") / ckpts.agents[0].relative_to(tmp_path)),
        files=describe_files(ckpts.agents[0]),
    )
    write_manifest(manifest, directory)
    with pytest.raises(ConfigError, match=r"resolves outside the manifest's directory .*allow-external-shards"):
        _merge_stage(ckpts, tmp_path, directory)
    report = _merge_stage(ckpts, tmp_path, directory, allow_external_shards=True)
    assert report["agents"][0]["name"] == "outside"


def test_non_finite_telemetry_in_a_manifest_keeps_the_report_strict_json(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    stage = stage_for(ckpts, 0)
    data = json.loads((stage / MANIFEST_NAME).read_text())  # a hand-edited manifest: Python's json writes NaN
    data.update(telemetry={"density": float("nan"), "rho": 0.25}, rewards={"reward": float("inf")})
    (stage / MANIFEST_NAME).write_text(json.dumps(data))
    _merge_stage(ckpts, tmp_path, stage)
    text = (tmp_path / "out" / "ram_merge_report.json").read_text()
    report = json.loads(text, parse_constant=lambda token: pytest.fail(f"invalid JSON token {token}"))
    assert report["agents"][0]["stage"]["telemetry"] == {"rho": 0.25}
    assert report["agents"][0]["stage"]["rewards"] == {}


def test_a_relative_base_model_resolves_beside_the_manifest(tmp_path, monkeypatch):
    ckpts = make_checkpoints(tmp_path / "inputs")
    stages = [stage_for(ckpts, t, base_model=str(Path("..") / ckpts.base.name)) for t in range(2)]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # the base is found from the manifests, not from the working directory
    result = ram_trl.analyze(None, stages, None, progress=False, figures=False)
    assert [a["name"] for a in result["agents"]] == ["vertical0", "vertical1"]
    # the merge report names the base the manifest means, not the bare relative path
    report = _merge_stage(ckpts, tmp_path, stages[0])
    assert report["agents"][0]["stage"]["base_model"] == str(ckpts.base.resolve())


def test_names_for_an_agent_that_is_the_base_say_why_it_was_left_out(tmp_path):
    ckpts = make_checkpoints(tmp_path)
    with pytest.raises(ConfigError, match=r"2 names given for 1 agents \(models\[0\] is the base model"):
        ram_trl.analyze(ckpts.base, [ckpts.base, ckpts.agents[0]], None, names=["b", "a"], progress=False)
