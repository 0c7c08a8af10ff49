"""Bad inputs: every refusal has the right exception type, a message naming the file / tensor / agent involved,
leaves no output directory (nor a temporary sibling) behind, and never touches the inputs."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ram_trl
from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError, OutputError, RamTrlError
from tests.helpers import (
    ALL_METHODS,
    BIAS,
    DOWN,
    EMBED,
    HIDDEN,
    INTER,
    UP,
    VOCAB,
    assert_no_output,
    base_tensors,
    config_for,
    failing_writer,
    leftovers,
    load_checkpoint,
    make_checkpoints,
    save_checkpoint,
    snapshot,
)

# ---------------------------------------------------------------------------------------------------------------
# Assertions


def assert_fails(config, out: Path, error: type[Exception], *needles: object, inputs: Path, **kwargs) -> str:
    """Merge must raise exactly ``error`` naming every needle, write nothing and leave ``inputs`` untouched."""
    before = snapshot(inputs)
    with pytest.raises(RamTrlError) as info:
        ram_trl.merge(config, out, progress=False, **kwargs)
    assert type(info.value) is error, f"expected {error.__name__}, got {type(info.value).__name__}: {info.value}"
    message = str(info.value)
    for needle in needles:
        assert str(needle) in message, f"{needle!r} not in error message {message!r}"
    assert_no_output(out)
    assert snapshot(inputs) == before, "inputs were modified"
    return message


# ---------------------------------------------------------------------------------------------------------------
# Missing and wrong directories


def test_sanity_the_fixture_merges(ckpts, out):
    report = ram_trl.merge(config_for(ckpts, "ram_plus"), out, progress=False)
    assert (out / "model.safetensors").is_file()
    assert set(load_checkpoint(out)) == set(ckpts.base_tensors)
    assert leftovers(out) == []
    assert all(0.05 < a["density"] < 0.2 for a in report["agents"])


def test_missing_base_dir(ckpts, out, tmp_path):
    missing = tmp_path / "no_such_base"
    config = config_for(ckpts)
    config["base_model"] = str(missing)
    assert_fails(config, out, ConfigError, "base_model", missing, inputs=ckpts.root)


def test_missing_agent_dir(ckpts, out, tmp_path):
    missing = tmp_path / "no_such_agent"
    config = config_for(ckpts, agents=[ckpts.agents[0], missing])
    assert_fails(config, out, ConfigError, "models[1]", missing, "does not exist", inputs=ckpts.root)


@pytest.mark.parametrize("role", ["base", "agent"])
def test_directory_that_is_not_a_checkpoint(ckpts, out, role):
    empty = ckpts.root / "not_a_model"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    (empty / "README.md").write_text("just a readme\n")
    if role == "base":
        config = config_for(ckpts)
        config["base_model"] = str(empty)
        needles = ("base model", empty, "not a checkpoint")
    else:
        config = config_for(ckpts, agents=[ckpts.agents[0], empty])
        needles = ("agent 1", empty, "not a checkpoint")
    assert_fails(config, out, CheckpointError, *needles, inputs=ckpts.root)


def test_lora_adapter_with_only_one_factor(ckpts, out):
    adapter = ckpts.root / "lora_agent"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    save_file(
        {"base_model.model.model.layers.0.mlp.up_proj.lora_A.weight": torch.zeros(4, HIDDEN)},
        str(adapter / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    config = config_for(ckpts, agents=[adapter])
    assert_fails(
        config,
        out,
        CheckpointError,
        "agent 0",
        adapter,
        "model.layers.0.mlp.up_proj",
        "both LoRA factors",
        inputs=ckpts.root,
    )


# ---------------------------------------------------------------------------------------------------------------
# Corrupt files


def _garbage(file: Path) -> None:
    file.write_bytes(b"this is definitely not a safetensors file\n" * 8)


def _invalid_json_header(file: Path) -> None:
    header = b'{"model.embed_tokens.weight": {"dtype": "F32", "shape": [16, 8], '  # cut off: invalid JSON
    header += b" " * (-len(header) % 8)
    file.write_bytes(struct.pack("<Q", len(header)) + header + bytes(512))


def _truncated(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:-7])


@pytest.mark.parametrize(
    ("corrupt", "what"),
    [(_garbage, "safetensors"), (_invalid_json_header, "header"), (_truncated, "truncated")],
    ids=["garbage", "invalid_json_header", "truncated"],
)
def test_corrupt_safetensors(ckpts, out, corrupt, what):
    file = ckpts.agents[1] / "model.safetensors"
    corrupt(file)
    assert_fails(config_for(ckpts), out, CheckpointError, "agent 1", file, what, inputs=ckpts.root)


def _shard(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    """Save ``tensors`` as two shards plus model.safetensors.index.json."""
    path.mkdir(parents=True)
    names = sorted(tensors)
    groups = [names[:2], names[2:]]
    weight_map = {}
    for i, group in enumerate(groups):
        file_name = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(path / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    return path


def test_sharded_agent_merges_like_a_single_file(ckpts, out, tmp_path):
    sharded = _shard(ckpts.root / "agent1_sharded", ckpts.agent_tensors[1])
    ram_trl.merge(config_for(ckpts, "ram_plus", agents=[ckpts.agents[0], sharded]), out, progress=False)
    reference = tmp_path / "reference"
    ram_trl.merge(config_for(ckpts, "ram_plus"), reference, progress=False)
    got, want = load_checkpoint(out), load_checkpoint(reference)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_sharded_index_lists_a_missing_shard(ckpts, out):
    sharded = _shard(ckpts.root / "agent1_sharded", ckpts.agent_tensors[1])
    missing = sharded / "model-00002-of-00002.safetensors"
    missing.unlink()
    config = config_for(ckpts, agents=[ckpts.agents[0], sharded])
    assert_fails(
        config, out, CheckpointError, "agent 1", missing, "missing", "model.safetensors.index.json", inputs=ckpts.root
    )


# ---------------------------------------------------------------------------------------------------------------
# Tensors that do not match the base


def test_tensor_missing_in_agent(tmp_path, out):
    def drop_bias(tensors):
        return {k: v for k, v in tensors.items() if k != BIAS}

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: drop_bias})
    assert_fails(
        config_for(ckpts), out, CheckpointError, "agent 1", BIAS, ckpts.agents[1], "missing", inputs=ckpts.root
    )


def test_tensor_missing_in_base(tmp_path, out):
    extra = "model.layers.0.mlp.gate_proj.weight"

    def add_tensor(tensors):
        return {**tensors, extra: torch.ones(INTER, HIDDEN)}

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={0: add_tensor})
    assert_fails(
        config_for(ckpts), out, CheckpointError, "agent 0", extra, "not in the base", ckpts.base, inputs=ckpts.root
    )


@pytest.mark.parametrize("shape_mismatch", ["error", "merge_common_rows"])
def test_shape_mismatch_of_columns(tmp_path, out, shape_mismatch):
    # Different trailing dimensions can never be merged, whatever shape_mismatch says.
    def widen(tensors):
        return {**tensors, UP: torch.randn(INTER, HIDDEN + 1)}

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: widen})
    config = config_for(ckpts, shape_mismatch=shape_mismatch)
    assert_fails(
        config,
        out,
        CheckpointError,
        UP,
        "agent 1",
        ckpts.agents[1],
        [INTER, HIDDEN + 1],
        [INTER, HIDDEN],
        inputs=ckpts.root,
    )


def test_shape_mismatch_of_rows_without_opt_in(tmp_path, out):
    def grow(tensors):
        return {**tensors, EMBED: torch.cat([tensors[EMBED], torch.randn(4, HIDDEN)])}

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={0: grow})
    assert_fails(
        config_for(ckpts),
        out,
        CheckpointError,
        EMBED,
        "agent 0",
        [VOCAB + 4, HIDDEN],
        [VOCAB, HIDDEN],
        "merge_common_rows",
        inputs=ckpts.root,
    )


@pytest.mark.parametrize("method", ["task_arithmetic", "ram_plus", "ties"])
def test_merge_common_rows_with_a_larger_vocabulary(tmp_path, method):
    extra_rows = 4
    g = torch.Generator().manual_seed(7)
    new_rows = torch.randn(extra_rows, HIDDEN, generator=g)

    def grow(tensors):
        return {**tensors, EMBED: torch.cat([tensors[EMBED], new_rows])}

    ckpts = make_checkpoints(tmp_path / "inputs", num_agents=1, overrides={0: grow})
    truncated_tensors = {**ckpts.agent_tensors[0], EMBED: ckpts.agent_tensors[0][EMBED][:VOCAB].clone()}
    truncated = save_checkpoint(tmp_path / "inputs" / "agent0_truncated", truncated_tensors)
    params = {"task_arithmetic": {"weight": 1.0}, "ties": {"weight": 1.0, "density": 0.5}}.get(method)
    before = snapshot(ckpts.root)

    out = tmp_path / "merged"
    report = ram_trl.merge(
        config_for(ckpts, method, agent_parameters=params, shape_mismatch="merge_common_rows"), out, progress=False
    )
    reference = tmp_path / "reference"
    ram_trl.merge(config_for(ckpts, method, agents=[truncated], agent_parameters=params), reference, progress=False)

    got, want = load_checkpoint(out), load_checkpoint(reference)
    assert got[EMBED].shape == (VOCAB + extra_rows, HIDDEN)
    assert torch.equal(got[EMBED][:VOCAB], want[EMBED])
    assert torch.equal(got[EMBED][VOCAB:], new_rows)
    for name in (UP, BIAS, DOWN):
        assert torch.equal(got[name], want[name]), name
    if method == "task_arithmetic":  # weight 1, one agent: the agent itself (up to float32 rounding of base + tau)
        torch.testing.assert_close(got[EMBED], ckpts.agent_tensors[0][EMBED])
    assert json.loads((out / "config.json").read_text())["vocab_size"] == VOCAB + extra_rows
    assert json.loads((reference / "config.json").read_text())["vocab_size"] == VOCAB
    assert report["output"]["resized_tensors"] == [EMBED]
    assert snapshot(ckpts.root) == before
    assert leftovers(out) == []


def test_nonfinite_in_extra_rows_is_refused(tmp_path, out):
    def grow_with_nan(tensors):
        rows = torch.randn(4, HIDDEN)
        rows[2, 3] = float("nan")
        return {**tensors, EMBED: torch.cat([tensors[EMBED], rows])}

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: grow_with_nan})
    config = config_for(ckpts, shape_mismatch="merge_common_rows")
    assert_fails(config, out, NonFiniteError, EMBED, "agent 1", inputs=ckpts.root)


# ---------------------------------------------------------------------------------------------------------------
# Non-finite values


def _poison(value: float, name: str = UP):
    def apply(tensors):
        poisoned = tensors[name].clone()
        poisoned[3, 2] = value
        return {**tensors, name: poisoned}

    return apply


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("method", ["task_arithmetic", "ram_plus", "ties"])
def test_nonfinite_agent_is_refused(tmp_path, out, value, method):
    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: _poison(value)})
    assert_fails(
        config_for(ckpts, method),
        out,
        NonFiniteError,
        UP,
        "agent 1",
        ckpts.agents[1],
        "allow_nonfinite",
        inputs=ckpts.root,
    )


@pytest.mark.parametrize("method", ["task_arithmetic", "ram_plus"])
def test_allow_nonfinite_merges_anyway(tmp_path, out, method):
    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: _poison(float("nan"))})
    ram_trl.merge(config_for(ckpts, method, allow_nonfinite=True), out, progress=False)
    merged = load_checkpoint(out)
    assert set(merged) == set(ckpts.base_tensors)
    for name in (EMBED, BIAS, DOWN):
        assert torch.isfinite(merged[name]).all(), name
    if method == "task_arithmetic":
        assert torch.isnan(merged[UP][3, 2])
    assert leftovers(out) == []


# ---------------------------------------------------------------------------------------------------------------
# Suspicious agents


@pytest.mark.parametrize("method", ["task_arithmetic", "ram_plus"])
def test_agent_identical_to_base_warns(tmp_path, out, method):
    # agent 1 holds exactly the base's values (a copy in its own directory, so it is not dropped as "the base")
    ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: lambda tensors: base_tensors(0)})
    with pytest.warns(UserWarning, match="density 0"):
        report = ram_trl.merge(config_for(ckpts, method), out, progress=False)
    flagged = [w for w in report["warnings"] if "density 0" in w]
    assert len(flagged) == 1 and "agent 1" in flagged[0]
    on_disk = json.loads((out / "ram_merge_report.json").read_text())
    assert any("density 0" in w for w in on_disk["warnings"])


def test_agent_that_differs_everywhere_warns_derived(tmp_path, out):
    def dense(tensors):
        g = torch.Generator().manual_seed(3)
        return {k: v + 0.01 + 0.01 * torch.rand(v.shape, generator=g) for k, v in base_tensors(0).items()}

    ckpts = make_checkpoints(tmp_path / "inputs", overrides={0: dense})
    with pytest.warns(UserWarning, match="derived"):
        report = ram_trl.merge(config_for(ckpts, "ram"), out, progress=False)
    flagged = [w for w in report["warnings"] if "derived" in w]
    assert len(flagged) == 1 and "agent 0" in flagged[0]


# ---------------------------------------------------------------------------------------------------------------
# The output directory


def _old_output(out: Path) -> dict[str, tuple[bytes, int]]:
    """A previous merge output (recognisable by its report: --overwrite may replace it)."""
    out.mkdir()
    (out / "ram_merge_report.json").write_text("{}\n")
    (out / "model.safetensors").write_bytes(b"old weights")
    (out / "old_marker.txt").write_text("from an earlier merge\n")
    return snapshot(out)


def test_output_exists_without_overwrite(ckpts, out):
    old = _old_output(out)
    before = snapshot(ckpts.root)
    with pytest.raises(RamTrlError) as info:
        ram_trl.merge(config_for(ckpts), out, progress=False)
    assert type(info.value) is OutputError
    assert str(out) in str(info.value) and "overwrite" in str(info.value)
    assert snapshot(out) == old
    assert leftovers(out) == []
    assert snapshot(ckpts.root) == before


def test_overwrite_replaces_the_output(ckpts, out):
    _old_output(out)
    ram_trl.merge(config_for(ckpts), out, overwrite=True, progress=False)
    assert not (out / "old_marker.txt").exists()
    assert set(load_checkpoint(out)) == set(ckpts.base_tensors)
    assert leftovers(out) == []


@pytest.mark.parametrize("failure", ["nonfinite", "interrupted"])
def test_failed_overwrite_keeps_the_old_output(tmp_path, out, monkeypatch, failure):
    if failure == "nonfinite":
        # task_arithmetic finds the NaN only in its write pass, after the temporary directory exists
        ckpts = make_checkpoints(tmp_path / "inputs", overrides={1: _poison(float("nan"), DOWN)})
        error: type[BaseException] = NonFiniteError
    else:
        ckpts = make_checkpoints(tmp_path / "inputs")
        failing_writer(monkeypatch, KeyboardInterrupt)
        error = KeyboardInterrupt
    old = _old_output(out)
    before = snapshot(ckpts.root)
    with pytest.raises(error):
        ram_trl.merge(config_for(ckpts, "task_arithmetic"), out, overwrite=True, progress=False)
    assert snapshot(out) == old
    assert leftovers(out) == []
    assert snapshot(ckpts.root) == before


def test_output_dir_that_is_an_input(ckpts):
    before = snapshot(ckpts.root)
    with pytest.raises(RamTrlError, match="overlaps the agent 0"):
        ram_trl.merge(config_for(ckpts), ckpts.agents[0], overwrite=True, progress=False)
    assert snapshot(ckpts.root) == before
    assert leftovers(ckpts.agents[0]) == []


def test_output_dir_that_contains_the_inputs(tmp_path):
    ckpts = make_checkpoints(tmp_path / "inputs")
    before = snapshot(ckpts.root)
    try:
        with pytest.raises(RamTrlError, match="which this run reads"):
            ram_trl.merge(config_for(ckpts), ckpts.root, overwrite=True, progress=False)
    finally:
        assert snapshot(ckpts.root) == before, "the inputs were deleted"


# ---------------------------------------------------------------------------------------------------------------
# Pickle checkpoints


def _to_pickle(path: Path) -> None:
    state = load_checkpoint(path)
    (path / "model.safetensors").unlink()
    torch.save(state, path / "pytorch_model.bin")


def test_pickle_refused_without_allow_pickle(ckpts, out):
    _to_pickle(ckpts.agents[0])
    assert_fails(
        config_for(ckpts), out, CheckpointError, "agent 0", ckpts.agents[0], "--allow-pickle", inputs=ckpts.root
    )


@pytest.mark.parametrize("method", ["ram_plus", "ties"])
@pytest.mark.parametrize("role", ["base", "agent"])
def test_pickle_with_allow_pickle_equals_safetensors(tmp_path, method, role):
    ckpts = make_checkpoints(tmp_path / "inputs")
    params = {"density": 0.5} if method == "ties" else None
    reference = tmp_path / "reference"
    ram_trl.merge(config_for(ckpts, method, agent_parameters=params), reference, progress=False, chunk_budget="1KB")
    _to_pickle(ckpts.base if role == "base" else ckpts.agents[1])
    out = tmp_path / "merged"
    with pytest.warns(UserWarning, match="pickle"):
        ram_trl.merge(
            config_for(ckpts, method, agent_parameters=params),
            out,
            progress=False,
            allow_pickle=True,
            chunk_budget="1KB",
        )
    got, want = load_checkpoint(out), load_checkpoint(reference)
    assert set(got) == set(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.filterwarnings("ignore:.*loading pickle checkpoint")
def test_corrupt_pickle_index(ckpts, out):
    _to_pickle(ckpts.agents[0])
    index = ckpts.agents[0] / "pytorch_model.bin.index.json"
    index.write_text('{"weight_map": {')
    assert_fails(config_for(ckpts), out, CheckpointError, "agent 0", index, inputs=ckpts.root, allow_pickle=True)


# ---------------------------------------------------------------------------------------------------------------
# Config errors (all raised before any tensor is read)


def test_unknown_merge_method_lists_available(ckpts, out):
    message = assert_fails(
        config_for(ckpts, "ram_pluss"), out, ConfigError, "ram_pluss", "merge_method", inputs=ckpts.root
    )
    for name in ALL_METHODS:
        assert name in message


def test_unknown_parameter_warns_with_the_accepted_ones(ckpts, out):
    """mergekit ignores parameters a method does not use (its own test configs set ``embed_slerp`` for every
    method); ram_trl ignores them with one warning that lists what the method takes (a typo shows there)."""
    with pytest.warns(UserWarning, match=r"'gamma' \(parameters\)") as caught:
        ram_trl.merge(config_for(ckpts, "ties", parameters={"gamma": 0.5}), out, progress=False)
    (message,) = [str(w.message) for w in caught if "does not use" in str(w.message)]
    for name in ("lambda", "normalize", "weight", "density"):
        assert name in message


def test_unknown_per_agent_parameter_warns_once_and_is_ignored(ckpts, out):
    """mergekit ignores per-model parameters a method does not use; ram_trl does too, with one warning naming them."""
    with pytest.warns(UserWarning, match=r"ties does not use the parameter\(s\) 'gamma' \(models\[0\]"):
        report = ram_trl.merge(config_for(ckpts, "ties", agent_parameters={"gamma": 0.5}), out, progress=False)
    assert sum("does not use" in w for w in report["warnings"]) == 1


def test_global_parameter_given_per_agent(ckpts, out):
    assert_fails(
        config_for(ckpts, "task_arithmetic", agent_parameters={"lambda": 0.5}),
        out,
        ConfigError,
        "lambda",
        "global",
        "models[0]",
        inputs=ckpts.root,
    )


@pytest.mark.parametrize("density", [1.5, -0.1])
@pytest.mark.parametrize("where", ["agent", "global"])
def test_density_out_of_range(ckpts, out, density, where):
    if where == "agent":
        config = config_for(ckpts, "ties", agent_parameters={"density": density})
        needles: tuple[object, ...] = ("density", density, "models[0]")
    else:
        config = config_for(ckpts, "dare_ties", parameters={"density": density})
        needles = ("density", density, "parameters")
    assert_fails(config, out, ConfigError, *needles, inputs=ckpts.root)


def test_mergekit_layer_slices_refused(ckpts, out):
    config = {
        "merge_method": "ties",
        "base_model": str(ckpts.base),
        "slices": [{"sources": [{"model": str(a), "layer_range": [0, 1]} for a in ckpts.agents]}],
    }
    assert_fails(config, out, ConfigError, "slices[0].sources[0]", "layer_range [0, 1]", inputs=ckpts.root)


def test_invalid_yaml(ckpts, out, tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(f"merge_method: ram\nbase_model: {ckpts.base}\nmodels: [\n  - model: {ckpts.agents[0]}\n")
    assert_fails(path, out, ConfigError, path, "YAML", inputs=ckpts.root)


def test_empty_models_list(ckpts, out):
    config = config_for(ckpts, "ram", agents=[])
    assert_fails(config, out, ConfigError, "models", "empty", inputs=ckpts.root)


def test_yaml_with_unknown_field_names_the_file(ckpts, out, tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text(f"merge_method: ram\nbase_model: {ckpts.base}\nmodels:\n  - model: {ckpts.agents[0]}\nsed: 3\n")
    assert_fails(path, out, ConfigError, path, "sed", inputs=ckpts.root)


# ---------------------------------------------------------------------------------------------------------------
# Interrupted merges


@pytest.mark.parametrize(
    ("exception", "method", "max_shard_size"),
    [
        (RuntimeError, "task_arithmetic", "5GB"),
        (RuntimeError, "ram_plus", "1KB"),
        (OSError, "ties", "1KB"),
        (KeyboardInterrupt, "ram", "5GB"),
    ],
)
def test_interrupted_merge_leaves_nothing(ckpts, out, monkeypatch, exception, method, max_shard_size):
    calls = failing_writer(monkeypatch, exception)
    before = snapshot(ckpts.root)
    with pytest.raises(exception, match="simulated failure"):
        ram_trl.merge(config_for(ckpts, method), out, progress=False, max_shard_size=max_shard_size)
    assert calls[0] >= 2, "the writer should have failed on its second call"
    assert_no_output(out)
    assert snapshot(ckpts.root) == before
    assert sorted(p.name for p in out.parent.iterdir()) == ["inputs"]


def test_merge_after_an_interrupted_merge_succeeds(ckpts, out, monkeypatch):
    failing_writer(monkeypatch, RuntimeError)
    with pytest.raises(RuntimeError):
        ram_trl.merge(config_for(ckpts), out, progress=False)
    monkeypatch.undo()
    ram_trl.merge(config_for(ckpts), out, progress=False)
    assert set(load_checkpoint(out)) == set(ckpts.base_tensors)
    assert leftovers(out) == []
