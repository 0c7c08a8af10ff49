"""Golden tests of TaskVectorTracker on hand-built tiny models whose task vectors are known element by element.

The base is all ones. Each trained element moves by one of four hand-picked amounts:

- ``S = 2**-20``: changed, but ``|tau| <= eps`` (inactive);
- ``M = 2**-10``: active in float32, but rounds back to 1.0 in bfloat16 (one bf16 step at 1.0 is ``2**-7``);
- ``L = 2**-6``: active in float32 and in bfloat16 (``1 + 2**-6`` is a bfloat16 value).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ram_trl.callbacks.telemetry import MappedCheckpointBase, ModelBase, TaskVectorTracker
from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.stage.manifest import fingerprint_checkpoint
from ram_trl.statistics import MagnitudeStatistics
from ram_trl.statistics.counting import active_mask
from tests.callbacks.telemetry.helpers import (
    NUMEL,
    SHAPES,
    TAU,
    L,
    M,
    P,
    peft_model,
    random_model,
    random_training,
    tiny_model,
    train,
    write_base,
    write_full_prior,
    write_lora_prior,
    write_stage,
)
from tests.helpers import magnitude_bin


def expected_counts() -> tuple[int, int, int]:
    flat = [v for values in TAU.values() for v in values]
    active = sum(abs(v) > 1e-5 for v in flat)
    changed = sum(v != 0 for v in flat)
    saved = sum(abs(v) == L for v in flat)
    return active, changed, saved


def test_hand_counts_are_what_the_table_says():
    assert expected_counts() == (8, 10, 5)


@pytest.mark.parametrize("source", ["disk", "reference", "snapshot"])
def test_golden_densities_buckets_and_magnitudes(tmp_path, source):
    base = write_base(tmp_path / "base")
    model = tiny_model()
    if source == "disk":
        tracker = TaskVectorTracker(save_dtype="bfloat16", base_model=base)
    elif source == "reference":
        tracker = TaskVectorTracker(save_dtype="bfloat16", reference_model=tiny_model())
    else:
        tracker = TaskVectorTracker(save_dtype="bfloat16")
        tracker.setup(model)  # snapshot before training
    train(model)
    out = tracker.measure(model, step=7)
    assert tracker.last_step == 7 and tracker.last == out
    assert out[f"{P}numel"] == NUMEL
    assert out[f"{P}active"] == 8 and out[f"{P}density"] == 8 / NUMEL
    assert out[f"{P}changed"] == 10 and out[f"{P}density_exact"] == 10 / NUMEL
    assert out[f"{P}active_saved"] == 5 and out[f"{P}density_saved"] == 5 / NUMEL
    modules = {k.split("/")[2]: v for k, v in out.items() if k.startswith(f"{P}module/")}
    assert modules == {"attn_q": 2 / 4, "mlp_up": 0.0, "norm": 0.0, "embedding": 1 / 6, "lm_head": 2 / 6}
    layers = {k.split("/")[2]: v for k, v in out.items() if k.startswith(f"{P}layer/")}
    assert layers == {"0": 2 / 4, "1": 0.0}
    # active float32 deltas: L, M (embedding), L, L, M (q_proj), M (norm), L, -L (lm_head)
    assert out[f"{P}magnitude/mean_abs"] == (5 * L + 3 * M) / 8
    values = torch.tensor([L, M, L, L, M, M, L, -L], dtype=torch.float64)
    assert out[f"{P}magnitude/std"] == pytest.approx(float(values.std(unbiased=False)), rel=1e-12)
    assert out[f"{P}measure_seconds"] > 0
    assert not any(k.startswith(f"{P}prior/") for k in out)
    if source == "snapshot":
        assert tracker.state_bytes == NUMEL * 4 and out[f"{P}state_mb"] == NUMEL * 4 / 2**20
    else:
        assert tracker.state_bytes == 0


@pytest.mark.parametrize("save_dtype, saved", [("float32", 8), ("float16", 8), ("bfloat16", 5)])
def test_saved_view_follows_save_dtype(tmp_path, save_dtype, saved):
    # one float16 step at 1.0 is 2**-10, so M survives a float16 save; S rounds away in every 16-bit dtype
    tracker = TaskVectorTracker(base_model=write_base(tmp_path / "base"), save_dtype=save_dtype)
    out = tracker.measure(train(tiny_model()))
    assert out[f"{P}active_saved"] == saved and out[f"{P}active"] == 8


def test_chunking_does_not_change_counts(tmp_path):
    base = write_base(tmp_path / "base")
    whole = TaskVectorTracker(base_model=base).measure(train(tiny_model()))
    pieces = TaskVectorTracker(base_model=base, chunk_elements=8).measure(train(tiny_model()))
    for key in ("active", "changed", "active_saved", "magnitude/mean_abs", "module/embedding/density"):
        assert whole[f"{P}{key}"] == pieces[f"{P}{key}"]


def test_measurement_threads_are_restored(tmp_path):
    before = torch.get_num_threads()
    tracker = TaskVectorTracker(base_model=write_base(tmp_path / "base"), threads=1)
    assert tracker.measure(train(tiny_model()))[f"{P}active"] == 8
    assert torch.get_num_threads() == before


@pytest.mark.parametrize("simulated", [1, 3, 6])
def test_default_workers_follow_the_thread_plan_and_change_no_value(tmp_path, monkeypatch, simulated):
    """With ``threads=None`` a measurement takes the telemetry workers of the thread plan of this process's cores
    (here simulated), and reports the same values as one worker, leaving torch's thread setting alone."""
    from ram_trl import parallel
    from ram_trl.callbacks.telemetry import tracker as tracker_module

    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(tracker_module, "SMALL_MODEL_ELEMENTS", 0)  # this small model uses the pool too
    base = random_model()
    save_file({n: p.detach().clone() for n, p in base.named_parameters()}, str(tmp_path / "model.safetensors"))
    model = random_training(random_model(), "dense")
    single = TaskVectorTracker(base_model=tmp_path, threads=1, chunk_elements=64).measure(model)
    monkeypatch.setattr(parallel, "available_cores", lambda: simulated)
    pools: list[int | None] = []

    def spy(device, workers=None, _pool=tracker_module.compute_pool):
        pools.append(workers)
        return _pool(device, workers)

    monkeypatch.setattr(tracker_module, "compute_pool", spy)
    before = torch.get_num_threads()
    with parallel.owned_process():  # the pools of a stage process (a guest measures on the calling thread)
        planned = TaskVectorTracker(base_model=tmp_path, chunk_elements=64).measure(model)
    assert pools == [parallel.plan_threads().telemetry] == [simulated]
    assert torch.get_num_threads() == before

    def values(out: dict[str, float]) -> dict[str, float]:
        return {k: v for k, v in out.items() if not k.endswith(("_seconds", "_mb"))}

    assert values(planned) == values(single)


def reference_counts(model: nn.Module, base: nn.Module, eps: float, save_dtype: torch.dtype) -> dict[str, float]:
    """The metrics the tracker must report, computed on whole tensors with MagnitudeStatistics.update."""
    trained = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    original = torch.cat([p.detach().reshape(-1) for p in base.parameters()])
    tau = trained - original
    saved = trained.to(save_dtype).float() - original.to(save_dtype).float()
    mask = active_mask(tau, eps)
    magnitudes = MagnitudeStatistics.zeros(1)
    magnitudes.update(tau.unsqueeze(0), mask.unsqueeze(0))
    out = {
        "active": int(mask.sum()),
        "changed": int((tau != 0).sum()),
        "active_saved": int(active_mask(saved, eps).sum()),
    }
    summary = magnitudes.summary(0)
    for key in ("mean_abs", "std", "excess_kurtosis", "gini", "top_1pct_mass", "top_5pct_mass"):
        out[f"magnitude/{key}"] = summary[key]
    return out


@pytest.mark.parametrize(
    "case, eps, save_dtype",
    [
        ("dense", 1e-5, torch.bfloat16),
        ("dense", 1e-5, torch.float32),  # saving changes nothing: the saved view is the float32 one
        ("nonfinite", 1e-5, torch.bfloat16),
        ("subnormal", 0.0, torch.bfloat16),
    ],
)
def test_workers_and_chunks_count_like_whole_tensors(tmp_path, case, eps, save_dtype):
    base = random_model()
    with torch.no_grad():
        base.model.layers[0].mlp.up_proj.weight[3, 5] = 0.0
    save_file({n: p.detach().clone() for n, p in base.named_parameters()}, str(tmp_path / "model.safetensors"))
    model = random_training(random_model(), case)
    outs = []
    for threads, chunk, magnitudes in [(1, 1 << 18, True), (1, 64, True), (3, 64, True), (3, 64, False)]:
        tracker = TaskVectorTracker(
            base_model=tmp_path,
            eps=eps,
            save_dtype=save_dtype,
            magnitudes=magnitudes,
            threads=threads,
            chunk_elements=chunk,
        )
        outs.append(tracker.measure(model))
        assert tracker._zero_fill == (eps > 0)
    expected = reference_counts(model, base, eps, save_dtype)
    counts = {k: v for k, v in outs.pop().items() if not k.endswith(("_seconds", "_mb"))}
    assert not any("/magnitude/" in k for k in counts)
    whole, sequential, parallel = ({k: v for k, v in o.items() if not k.endswith(("_seconds", "_mb"))} for o in outs)
    assert parallel == sequential  # chunk results are added in chunk order, whatever the workers
    for key, value in expected.items():
        if math.isnan(value):
            assert f"{P}{key}" not in whole and f"{P}{key}" not in parallel
        elif key.startswith("magnitude/"):
            assert whole[f"{P}{key}"] == pytest.approx(value, rel=1e-9)
            assert parallel[f"{P}{key}"] == pytest.approx(value, rel=1e-9)
        else:
            assert whole[f"{P}{key}"] == parallel[f"{P}{key}"] == counts[f"{P}{key}"] == value
    if case == "subnormal":  # an active magnitude in bin 0: only eps below 2**-133 counts one, with a gather
        assert magnitude_bin(model.model.layers[0].mlp.up_proj.weight[3, 5]).item() == 0
    if case == "nonfinite":  # chunks with NaN or inf are gathered too
        assert expected["magnitude/mean_abs"] == math.inf and whole[f"{P}magnitude/mean_abs"] == math.inf


def test_magnitudes_of_a_systematic_sample_of_windows(tmp_path):
    base = random_model()
    save_file({n: p.detach().clone() for n, p in base.named_parameters()}, str(tmp_path / "model.safetensors"))
    model = random_training(random_model(), "dense")
    numel = sum(p.numel() for p in model.parameters())  # 4768: with windows of 64, every 4th is sampled
    exact = TaskVectorTracker(base_model=tmp_path, chunk_elements=64).measure(model)
    outs = [
        TaskVectorTracker(base_model=tmp_path, chunk_elements=64, magnitude_sample=1000, threads=t).measure(model)
        for t in (1, 3)
    ]
    assert exact[f"{P}magnitude/sample_fraction"] == 1.0
    assert outs[0][f"{P}magnitude/sample_fraction"] == 1 / (numel // 1000) == 0.25
    # the reference: the model's task vector laid end to end in parameter order, windows 0, 4, 8, ... of 64
    tau = torch.cat(
        [(p.detach() - q.detach()).reshape(-1) for p, q in zip(model.parameters(), base.parameters(), strict=True)]
    )
    window = torch.arange(tau.numel()) // 64
    sample = tau[window % 4 == 0]
    reference = MagnitudeStatistics.zeros(1)
    reference.update(sample.unsqueeze(0), active_mask(sample, 1e-5).unsqueeze(0))
    summary = reference.summary(0)
    for out in outs:
        for key in ("mean_abs", "std", "excess_kurtosis", "gini", "top_1pct_mass", "top_5pct_mass"):
            assert out[f"{P}magnitude/{key}"] == pytest.approx(summary[key], rel=1e-9)
        # the densities count every element, as without a sample
        for key, value in exact.items():
            if "magnitude/" not in key and not key.endswith(("_seconds", "_mb")):
                assert out[key] == value, key
    assert outs[0][f"{P}magnitude/gini"] != exact[f"{P}magnitude/gini"]  # the sample is not the whole


def test_eps_is_strict(tmp_path):
    tracker = TaskVectorTracker(base_model=write_base(tmp_path / "base", torch.float32), eps=L, save_dtype="float32")
    out = tracker.measure(train(tiny_model()))
    assert out[f"{P}active"] == 0 and out[f"{P}changed"] == 10
    assert f"{P}magnitude/mean_abs" not in out  # undefined without active elements: left out


def test_memory_mapped_base_is_not_copied(tmp_path):
    base = MappedCheckpointBase(write_base(tmp_path / "base"))
    values = base.read("model.layers.0.self_attn.q_proj.weight", 1, 3)
    assert values.dtype == torch.bfloat16 and values.tolist() == [1.0, 1.0, 1.0]
    mapped = base._maps[base.info("model.norm.weight").file]
    start = mapped.ctypes.data
    assert start <= values.data_ptr() < start + mapped.nbytes
    assert base.nbytes == 0
    with pytest.raises(CheckpointError, match="has 4 elements"):
        base.read("model.layers.0.self_attn.q_proj.weight", 2, 3)


# ---------------------------------------------------------------------------------------------------------------
# Prior stages


def test_prior_stage_overlap_rho_and_lambda(tmp_path):
    base = write_base(tmp_path / "base")
    stages = [
        write_stage(tmp_path, "full", write_full_prior(tmp_path / "agent_full"), base),
        write_stage(tmp_path, "lora", write_lora_prior(tmp_path / "agent_lora"), base),
    ]
    tracker = TaskVectorTracker(save_dtype="bfloat16", base_model=base, prior_stages=stages)
    out = tracker.measure(train(tiny_model()))
    # this run's bf16-active elements: embed[0], q[0], q[1], lm_head[0], lm_head[5]
    # the full prior has embed[0], q[0]; the LoRA prior q[0], q[1]: shared 3, unique 2
    assert out[f"{P}prior/overlap"] == 3 / 5
    assert out[f"{P}prior/full/overlap"] == 2 / 5
    assert out[f"{P}prior/lora/overlap"] == 2 / 5
    assert out[f"{P}prior/rho"] == 1.5
    assert out[f"{P}prior/lambda_ram_plus"] == 1 + 0.1 * 1.5
    assert out[f"{P}prior/lambda_ram_plus_soft"] == 1 + 0.1 * 1.5 / 2.5
    # one bit per element and prior kept
    assert tracker.priors.nbytes == sum(2 * math.ceil(math.prod(s) / 8) for s in SHAPES.values())
    assert tracker.summary()["prior_stages"] == ["full", "lora"]
    alpha_capped = TaskVectorTracker(save_dtype="bfloat16", base_model=base, prior_stages=stages, r=0.5, alpha=1.0)
    assert alpha_capped.measure(train(tiny_model()))[f"{P}prior/lambda_ram_plus"] == 1.5
    # saving in float32 changes nothing: the saved view is the float32 one (8 active elements, the same 3 shared)
    exact = TaskVectorTracker(base_model=base, prior_stages=stages, save_dtype="float32")
    out = exact.measure(train(tiny_model()))
    assert out[f"{P}active_saved"] == 8 and out[f"{P}prior/overlap"] == 3 / 8 and out[f"{P}prior/rho"] == 3 / 5


def test_prior_rho_is_inf_when_nothing_is_unique(tmp_path):
    base = write_base(tmp_path / "base")
    agent = tmp_path / "same"
    agent.mkdir()
    tensors = {n: (torch.ones(s) + torch.tensor(TAU[n]).reshape(s)).to(torch.bfloat16) for n, s in SHAPES.items()}
    save_file(tensors, str(agent / "model.safetensors"))
    tracker = TaskVectorTracker(
        save_dtype="bfloat16", base_model=base, prior_stages=[write_stage(tmp_path, "twin", agent, base)]
    )
    out = tracker.measure(train(tiny_model()))
    assert out[f"{P}prior/overlap"] == 1.0 and out[f"{P}prior/rho"] == math.inf
    assert out[f"{P}prior/lambda_ram_plus"] == 1 + 0.1 * 2.0


def test_prior_stage_of_another_base_is_refused(tmp_path):
    base = write_base(tmp_path / "base")
    other = tmp_path / "other"
    other.mkdir()
    tensors = {n: torch.ones(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    for t in tensors.values():
        t.view(-1)[0] = 2.0
    save_file(tensors, str(other / "model.safetensors"))
    stage = write_stage(tmp_path, "elsewhere", write_full_prior(tmp_path / "agent"), other)
    with pytest.raises(ConfigError, match=r"prior stage 'elsewhere' .* fingerprint differs"):
        TaskVectorTracker(base_model=base, prior_stages=[stage]).setup(tiny_model())


def test_a_base_with_one_nan_outside_the_fingerprint_is_warned_about_once(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    tensors = {n: torch.ones(s, dtype=torch.bfloat16) for n, s in SHAPES.items()}
    outside = next(n for n in SHAPES if n not in fingerprint_checkpoint(write_base(tmp_path / "b0")).tensors)
    tensors[outside].view(-1)[-1] = float("nan")
    save_file(tensors, str(base / "model.safetensors"))
    tracker = TaskVectorTracker(base_model=base)
    with pytest.warns(UserWarning, match=rf"base checkpoint {base} .*tensor '{outside}' holds 1 NaN/Inf value"):
        tracker.measure(train(tiny_model()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tracker.measure(train(tiny_model()))  # checked once


def test_prior_stage_without_a_fingerprint_from_another_base_is_warned_about(tmp_path):
    base = write_base(tmp_path / "base")
    other = write_base(tmp_path / "other")
    stage = write_stage(tmp_path, "old", write_full_prior(tmp_path / "agent"), other)
    manifest = json.loads((stage / "ram_stage.json").read_text())
    del manifest["base_fingerprint"]
    (stage / "ram_stage.json").write_text(json.dumps(manifest))
    with pytest.warns(UserWarning, match=rf"prior stage 'old' \({stage}/ram_stage.json\) has no base fingerprint"):
        TaskVectorTracker(base_model=base, prior_stages=[stage]).setup(tiny_model())
    manifest["base_model"] = str(base)  # the same base by name: nothing to warn about
    (stage / "ram_stage.json").write_text(json.dumps(manifest))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TaskVectorTracker(base_model=base, prior_stages=[stage]).setup(tiny_model())


def test_prior_stages_need_a_base_on_disk(tmp_path):
    base = write_base(tmp_path / "base")
    stage = write_stage(tmp_path, "p", write_full_prior(tmp_path / "agent"), base)
    manifest = json.loads((stage / "ram_stage.json").read_text())
    manifest["base_model"] = "hub-org/some-base"
    (stage / "ram_stage.json").write_text(json.dumps(manifest))
    tracker = TaskVectorTracker(reference_model=tiny_model(), prior_stages=[stage])
    with pytest.raises(ConfigError, match="base_model=PATH"):
        tracker.setup(tiny_model())


def test_missing_prior_checkpoint_is_named(tmp_path):
    base = write_base(tmp_path / "base")
    stage = write_stage(tmp_path, "gone", tmp_path / "nowhere", base)
    with pytest.raises(ConfigError, match=r"prior stage 'gone' .* does not exist"):
        TaskVectorTracker(base_model=base, prior_stages=[stage]).setup(tiny_model())


# ---------------------------------------------------------------------------------------------------------------
# PEFT


def test_peft_lora_delta_and_modules_to_save(tmp_path):
    model = peft_model()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    with torch.no_grad():
        # float32 delta: [[L * 1.0035, L], [9.98e-6 * 1.0035, 9.98e-6]] -> 3 active (1.0015e-5 > eps), 4 changed;
        # in bf16 the factors round to [1, 1] and [L, 167 * 2**-24 = 9.954e-6]: 2 active
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0035, 1.0]]))
        layer.lora_B["default"].weight.copy_(torch.tensor([[L], [9.98e-6]]))
        model.base_model.model.lm_head.modules_to_save["default"].weight.view(-1)[0] += L
    tracker = TaskVectorTracker(save_dtype="bfloat16")
    out = tracker.measure(model)
    assert tracker.kind == "lora" and tracker.base_description == "frozen base weights of the PEFT model"
    assert out[f"{P}numel"] == NUMEL
    assert (out[f"{P}active"], out[f"{P}changed"], out[f"{P}active_saved"]) == (4, 5, 3)
    assert out[f"{P}module/attn_q/density"] == 2 / 4 and out[f"{P}module/lm_head/density"] == 1 / 6
    # the base fingerprint is the adapter-disabled model's: equal to the base checkpoint's
    assert tracker.base_fingerprint == fingerprint_checkpoint(write_base(tmp_path / "base"))


# ---------------------------------------------------------------------------------------------------------------
# Model layouts and names


def test_wrapped_model_measures_like_the_plain_one(tmp_path):
    base = write_base(tmp_path / "base")

    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.module = inner

    out = TaskVectorTracker(save_dtype="bfloat16", base_model=base).measure(Wrapper(train(tiny_model())))
    assert out[f"{P}active"] == 8 and out[f"{P}active_saved"] == 5


def test_unsupported_layouts_are_named(tmp_path):
    base = write_base(tmp_path / "base")
    model = tiny_model()
    model.extra = nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=r"has no tensor 'extra.weight'"):
        TaskVectorTracker(base_model=base).setup(model)
    model = tiny_model()
    model.lm_head = nn.Linear(2, 4, bias=False)
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' has shape \[3, 2\].*\[4, 2\]"):
        TaskVectorTracker(base_model=base).setup(model)
    adapter = write_lora_prior(tmp_path / "adapter")
    with pytest.raises(CheckpointError, match="PEFT adapter"):
        TaskVectorTracker(base_model=adapter).setup(tiny_model())
    with pytest.raises(CheckpointError, match="reference model: has no tensor .lm_head.weight."):
        reference = tiny_model()
        del reference.lm_head
        reference.head = nn.Linear(2, 3, bias=False)
        TaskVectorTracker(reference_model=reference).measure(tiny_model())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eps": -1}, "eps"),
        ({"save_dtype": "int8"}, "save_dtype"),
        ({"chunk_elements": 12}, "chunk_elements"),
        ({"base_model": "/no/such/base"}, "does not exist"),
        ({"r": -0.1}, "r="),
        ({"threads": 0}, "threads"),
        ({"magnitude_sample": 100, "chunk_elements": 128}, "magnitude_sample"),
    ],
)
def test_bad_tracker_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TaskVectorTracker(**kwargs)


def test_model_base_refuses_a_range_it_does_not_hold():
    from ram_trl.callbacks.telemetry.shards import LocalShard

    shard = LocalShard("w", torch.arange(4.0), (8,), 4, True)
    base = ModelBase({"w": shard}, "reference model")
    assert base.read("w", 5, 2).tolist() == [1.0, 2.0]
    with pytest.raises(CheckpointError, match="partitioned differently"):
        base.read("w", 2, 4)


def test_a_prior_stage_finds_its_relative_base_beside_its_manifest(tmp_path, monkeypatch):
    """Without base_model, the priors' base is the one their manifests name: a relative path is read from the
    manifest's directory, not from the working directory."""
    base = write_base(tmp_path / "base")
    stage = write_stage(tmp_path, "full", write_full_prior(tmp_path / "agent_full"), base)
    manifest = json.loads((stage / "ram_stage.json").read_text())
    (stage / "ram_stage.json").write_text(json.dumps({**manifest, "base_model": "../base"}))
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)  # "../base" from here does not exist
    expected = TaskVectorTracker(save_dtype="bfloat16", base_model=base, prior_stages=[stage]).measure(
        train(tiny_model())
    )
    out = TaskVectorTracker(save_dtype="bfloat16", reference_model=tiny_model(), prior_stages=[stage]).measure(
        train(tiny_model())
    )
    assert out[f"{P}prior/full/overlap"] == expected[f"{P}prior/full/overlap"] == 2 / 5
