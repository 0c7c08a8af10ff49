"""Merges exported as PEFT LoRA adapters (``output_format="lora"``), loaded back with real PEFT."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

import ram_trl
from ram_trl.cli import main
from ram_trl.errors import ConfigError
from ram_trl.merging.lora import export as lora_export
from tests.helpers import qwen_model

peft = pytest.importorskip("peft", reason="peft is needed to load the exported adapters")

PROMPT = torch.tensor([[1, 5, 9, 2]])


def _qwen(seed: int = 0, **overrides) -> torch.nn.Module:
    return qwen_model(seed, **overrides).eval()


def _save_base(path: Path, **overrides) -> Path:
    _qwen(**overrides).save_pretrained(path)
    return path


def _full_agent(base: Path, path: Path, deltas: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full checkpoint: the base plus ``deltas``; returns its tensors."""
    state = load_file(str(base / "model.safetensors"))
    for name, delta in deltas.items():
        state[name] = state[name] + delta
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text((base / "config.json").read_text())
    return state


def _config(base: Path, agents: list[Path], **extra) -> dict:
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(base),
        "models": [{"model": str(a), "parameters": {"weight": 1.0}} for a in agents],
        "out_dtype": "float32",
        **extra,
    }


def _low_rank(shape: tuple[int, int], singular_values: list[float], seed: int) -> torch.Tensor:
    """U diag(S) V^T with orthonormal U, V (float64), as float32."""
    g = torch.Generator().manual_seed(seed)
    k = len(singular_values)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=g, dtype=torch.float64))
    return (u * torch.tensor(singular_values, dtype=torch.float64)) @ v.T


def _load_adapter(base: Path, adapter: Path):
    return peft.PeftModel.from_pretrained(Qwen2ForCausalLM.from_pretrained(base).float().eval(), adapter).eval()


def _leftovers(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".ram-trl-" in p.name)


def test_round_trip_of_an_exactly_rank_4_merge(tmp_path):
    base = _save_base(tmp_path / "base")
    (base / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]
    )
    peft.get_peft_model(_qwen(), lora).save_pretrained(tmp_path / "agent")
    config = _config(base, [tmp_path / "agent"])
    ram_trl.merge(config, tmp_path / "full", progress=False)
    report = ram_trl.merge(config, tmp_path / "adapter", progress=False, output_format="lora", lora_rank=4)

    adapter = tmp_path / "adapter"
    assert {p.name for p in adapter.iterdir()} == {
        "adapter_config.json",
        "adapter_model.safetensors",
        "README.md",
        "ram_merge_report.json",
        "tokenizer_config.json",
    }
    assert _leftovers(tmp_path) == []  # the temporary full merge is gone
    modules = [
        f"model.layers.{i}.{m}" for i in (0, 1) for m in ("mlp.down_proj", "self_attn.q_proj", "self_attn.v_proj")
    ]
    section = report["lora_export"]
    assert [t["module"] for t in section["tensors"]] == modules
    assert [t["rank"] for t in section["tensors"]] == [4] * 6
    for item in section["tensors"]:
        assert item["relative_error"] < 1e-5, item
    assert section["modules_to_save"] == [] and section["not_exported"] == [] and section["biases"] == []
    assert section["unchanged_tensors"] == 21
    assert json.loads((adapter / "ram_merge_report.json").read_text())["lora_export"]["tensors"] == section["tensors"]
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["peft_type"] == "LORA" and adapter_config["task_type"] == "CAUSAL_LM"
    assert (adapter_config["r"], adapter_config["lora_alpha"], adapter_config["rank_pattern"]) == (4, 4, {})
    assert adapter_config["target_modules"] == modules
    assert adapter_config["base_model_name_or_path"] == str(base.resolve())
    factors = load_file(str(adapter / "adapter_model.safetensors"))
    assert factors["base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"].shape == (4, 64)
    assert factors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"].shape == (32, 4)
    card = (adapter / "README.md").read_text()
    assert "library_name: peft" in card and "## LoRA export" in card and "## Agents" in card

    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    model = _load_adapter(base, adapter)
    full_model = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, full_model(PROMPT).logits, rtol=1e-5, atol=1e-5)
    generated = model.generate(PROMPT, max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 9)
    assert torch.equal(generated, full_model.generate(PROMPT, max_new_tokens=5, do_sample=False))
    merged = model.merge_and_unload().state_dict()
    base_state = load_file(str(base / "model.safetensors"))
    for name, value in full.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)
        if name.rpartition(".")[0] not in modules:
            assert torch.equal(merged[name], base_state[name]), name

    # ram_trl reads its own export back as a LoRA agent: the same model again
    ram_trl.merge(_config(base, [adapter]), tmp_path / "again", progress=False)
    for name, value in load_file(str(tmp_path / "again" / "model.safetensors")).items():
        torch.testing.assert_close(value, full[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_lower_rank_reports_the_discarded_singular_values(tmp_path):
    """Rank 3 of a rank-4 delta: the error is sqrt(S_4^2 / sum S^2), computed independently here."""
    base = _save_base(tmp_path / "base")
    torch.manual_seed(1)
    lora = peft.LoraConfig(init_lora_weights=False, r=4, lora_alpha=8, target_modules=["q_proj"])
    peft.get_peft_model(_qwen(), lora).save_pretrained(tmp_path / "agent")
    ram_trl.merge(_config(base, [tmp_path / "agent"]), tmp_path / "full", progress=False)
    report = lora_export.export_lora(base, tmp_path / "full", tmp_path / "adapter", rank=3)
    base_state = load_file(str(base / "model.safetensors"))
    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    assert len(report["lora_export"]["tensors"]) == 2
    for item in report["lora_export"]["tensors"]:
        name = item["tensor"]
        s = torch.linalg.svdvals(full[name].double() - base_state[name].double())
        expected = math.sqrt(float(s[3] ** 2 / (s**2).sum()))
        assert expected > 1e-2  # a real loss: rank 3 cannot hold this delta
        assert item["rank"] == 3
        assert item["relative_error"] == pytest.approx(expected, rel=1e-5)
        assert item["energy_kept"] == pytest.approx(1 - expected**2, rel=1e-9)


def test_energy_mode_through_the_cli(tmp_path, capsys):
    base = _save_base(tmp_path / "base")
    q0, o1, v1 = (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.self_attn.o_proj.weight",
        "model.layers.1.self_attn.v_proj.weight",
    )
    deltas = {
        q0: _low_rank((32, 32), [0.3, 0.2, 0.1], seed=1),  # shares 9/14, 13/14, 1 -> rank 2 at 0.9
        o1: _low_rank((32, 32), [0.1] * 6, seed=2),  # flat: 6 needed, capped at max_rank 4
        v1: _low_rank((16, 32), [0.5], seed=3),  # rank 1
    }
    _full_agent(base, tmp_path / "agent", {k: v.float() for k, v in deltas.items()})
    config = tmp_path / "merge.json"
    config.write_text(json.dumps(_config(base, [tmp_path / "agent"])))
    out = tmp_path / "adapter"
    argv = ["merge", str(config), str(out), "--no-progress", "--output-format", "lora", "--max-rank", "4"]
    assert main([*argv, "--energy", "0.9"]) == 0
    err = capsys.readouterr().err
    # the summary names the adapter and its size, not the temporary full model it was cut from
    assert f"-> {out}" in " ".join(err.split()) and ".ram-trl-full" not in err
    from ram_trl.sizes import format_bytes

    assert f"wrote {format_bytes((out / 'adapter_model.safetensors').stat().st_size)} in 1 file(s)" in err
    adapter_config = json.loads((out / "adapter_config.json").read_text())
    expected = {
        "model.layers.0.self_attn.q_proj": 2,
        "model.layers.1.self_attn.o_proj": 4,
        "model.layers.1.self_attn.v_proj": 1,
    }
    assert adapter_config["rank_pattern"] == expected
    assert adapter_config["alpha_pattern"] == expected
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 4)
    section = json.loads((out / "ram_merge_report.json").read_text())["lora_export"]
    assert (section["mode"], section["max_rank"], section["energy"]) == ("energy", 4, 0.9)
    errors = {item["tensor"]: item["relative_error"] for item in section["tensors"]}
    kept = {item["tensor"]: item["energy_kept"] for item in section["tensors"]}
    # the float32 storage of the merge adds ~1e-7 relative noise to the constructed spectra
    assert errors[q0] == pytest.approx(math.sqrt(1 / 14), rel=1e-4)
    assert kept[q0] == pytest.approx(13 / 14, rel=1e-6)
    assert errors[o1] == pytest.approx(math.sqrt(2 / 6), rel=1e-4)
    assert errors[v1] < 1e-5
    model = _load_adapter(base, out)
    layers = model.base_model.model.model.layers
    assert layers[0].self_attn.q_proj.lora_A["default"].weight.shape == (2, 32)
    assert layers[1].self_attn.o_proj.lora_A["default"].weight.shape == (4, 32)
    assert layers[1].self_attn.v_proj.lora_B["default"].weight.shape == (16, 1)
    assert layers[0].self_attn.q_proj.scaling["default"] == 1.0
    assert "LoRA adapter ->" in err


def test_norms_biases_and_embeddings_are_saved_in_full_and_restored_exactly(tmp_path):
    base = _save_base(tmp_path / "base")
    g = torch.Generator().manual_seed(7)
    deltas = {
        "model.norm.weight": torch.randn(32, generator=g) * 0.1,
        "model.layers.0.input_layernorm.weight": torch.randn(32, generator=g) * 0.1,
        "model.embed_tokens.weight": torch.randn(96, 32, generator=g) * 0.01,
        "model.layers.0.self_attn.q_proj.weight": _low_rank((32, 32), [0.4, 0.2], seed=4).float(),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(32, generator=g) * 0.1,  # bias of a LoRA module
        "model.layers.1.self_attn.k_proj.bias": torch.randn(16, generator=g) * 0.1,  # bias alone
        "lm_head.weight": _low_rank((96, 32), [0.3, 0.1], seed=5).float(),
    }
    _full_agent(base, tmp_path / "agent", deltas)
    config = _config(base, [tmp_path / "agent"])
    ram_trl.merge(config, tmp_path / "full", progress=False)
    report = ram_trl.merge(config, tmp_path / "adapter", progress=False, output_format="lora", lora_rank=2)
    section = report["lora_export"]
    saved = ["model.embed_tokens", "model.layers.0.input_layernorm", "model.norm"]
    assert [s["module"] for s in section["modules_to_save"]] == saved
    assert section["biases"] == ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.self_attn.k_proj.bias"]
    assert [t["module"] for t in section["tensors"]] == ["lm_head", "model.layers.0.self_attn.q_proj"]
    assert section["not_exported"] == []
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == saved
    assert adapter_config["bias"] == "all"  # k_proj's bias changed without its weight
    keys = set(load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")))
    assert "base_model.model.model.layers.0.self_attn.q_proj.base_layer.bias" in keys
    assert "base_model.model.model.layers.1.self_attn.k_proj.bias" in keys
    assert "base_model.model.model.norm.weight" in keys

    full = load_file(str(tmp_path / "full" / "model.safetensors"))
    model = _load_adapter(base, tmp_path / "adapter")
    wrapped = model.base_model.model.model.norm
    assert type(wrapped).__name__ == "ModulesToSaveWrapper"
    assert torch.equal(wrapped.modules_to_save["default"].weight, full["model.norm.weight"])
    full_model = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, full_model(PROMPT).logits, rtol=1e-5, atol=1e-5)
    merged = model.merge_and_unload().state_dict()
    exact = [
        "model.norm.weight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.bias",
        "model.layers.1.self_attn.k_proj.bias",
    ]
    for name in exact:
        assert torch.equal(merged[name], full[name]), name
        assert not torch.equal(full[name], load_file(str(base / "model.safetensors"))[name]), name
    for name, value in full.items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)


def test_tied_embeddings_keep_their_tie(tmp_path):
    base = _save_base(tmp_path / "base", tie_word_embeddings=True)
    g = torch.Generator().manual_seed(3)
    deltas = {
        "model.embed_tokens.weight": torch.randn(96, 32, generator=g) * 0.01,
        "model.layers.1.mlp.up_proj.weight": _low_rank((64, 32), [0.2], seed=6).float(),
    }
    _full_agent(base, tmp_path / "agent", deltas)
    config = _config(base, [tmp_path / "agent"])
    ram_trl.merge(config, tmp_path / "full", progress=False)
    ram_trl.merge(config, tmp_path / "adapter", progress=False, output_format="lora", lora_rank=1)
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == ["model.embed_tokens"]
    assert adapter_config["ensure_weight_tying"] is True
    model = _load_adapter(base, tmp_path / "adapter")
    full_model = AutoModelForCausalLM.from_pretrained(tmp_path / "full").eval()
    with torch.no_grad():
        torch.testing.assert_close(model(PROMPT).logits, full_model(PROMPT).logits, rtol=1e-5, atol=1e-5)
    merged = model.merge_and_unload()
    embedding = load_file(str(tmp_path / "full" / "model.safetensors"))["model.embed_tokens.weight"]
    assert torch.equal(merged.model.embed_tokens.weight, embedding)
    assert torch.equal(merged.lm_head.weight, embedding)


def test_a_resized_vocabulary_is_reported_not_exported(tmp_path):
    base = _save_base(tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(2)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        state[name] = torch.cat([state[name], torch.randn(4, 32, generator=g) * 0.02])
    state["model.layers.0.self_attn.q_proj.weight"] += _low_rank((32, 32), [0.2], seed=8).float()
    (tmp_path / "agent").mkdir()
    save_file(state, str(tmp_path / "agent" / "model.safetensors"), metadata={"format": "pt"})
    agent_config = json.loads((base / "config.json").read_text())
    (tmp_path / "agent" / "config.json").write_text(json.dumps({**agent_config, "vocab_size": 100}))
    config = _config(base, [tmp_path / "agent"], shape_mismatch="merge_common_rows")
    with pytest.warns(UserWarning, match="lm_head.weight is not exported"):
        report = ram_trl.merge(config, tmp_path / "adapter", progress=False, output_format="lora", lora_rank=1)
    reasons = {item["tensor"]: item["reason"] for item in report["lora_export"]["not_exported"]}
    assert set(reasons) == {"model.embed_tokens.weight", "lm_head.weight"}
    assert "shape [100, 32] differs from the base's [96, 32]" in reasons["lm_head.weight"]
    assert any("lm_head.weight is not exported" in w for w in report["warnings"])
    assert "**Not exported**" in (tmp_path / "adapter" / "README.md").read_text()
    assert [t["module"] for t in report["lora_export"]["tensors"]] == ["model.layers.0.self_attn.q_proj"]
    _load_adapter(base, tmp_path / "adapter")


def test_no_linear_changed_and_a_tensor_without_a_module(tmp_path):
    """Only a norm and a tensor the architecture does not have: PEFT's dummy target, one module saved, one reported."""
    base = _save_base(tmp_path / "base")
    state = load_file(str(base / "model.safetensors"))
    save_file(
        {**state, "model.extra_scale": torch.ones(4)}, str(base / "model.safetensors"), metadata={"format": "pt"}
    )
    _full_agent(
        base, tmp_path / "agent", {"model.norm.weight": torch.full((32,), 0.5), "model.extra_scale": torch.ones(4)}
    )
    with pytest.warns(UserWarning, match="model.extra_scale is not exported"):
        report = ram_trl.merge(
            _config(base, [tmp_path / "agent"]),
            tmp_path / "adapter",
            progress=False,
            output_format="lora",
            lora_rank=8,
        )
    section = report["lora_export"]
    assert section["tensors"] == [] and [s["module"] for s in section["modules_to_save"]] == ["model.norm"]
    assert [item["tensor"] for item in section["not_exported"]] == ["model.extra_scale"]
    assert (
        "Qwen2ForCausalLM (built from the base's config.json) has no parameter" in section["not_exported"][0]["reason"]
    )
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["target_modules"] == "dummy-target-modules"
    model = _load_adapter(base, tmp_path / "adapter")
    assert torch.equal(model.merge_and_unload().model.norm.weight, state["model.norm.weight"] + 0.5)


BAD_OPTIONS = [
    ({"output_format": "lora", "lora_rank": 0}, "--rank must be an integer >= 1"),
    ({"output_format": "lora", "lora_max_rank": 4, "lora_energy": 1.5}, "--energy must be a number in (0, 1]"),
    ({"output_format": "lora", "lora_max_rank": 4, "lora_energy": 0.0}, "--energy must be a number in (0, 1]"),
    ({"output_format": "full", "lora_rank": 4}, "--rank applies only to --output-format lora"),
    ({"lora_max_rank": 4, "lora_energy": 0.9}, "--max-rank and --energy apply only to --output-format lora"),
    (
        {"output_format": "lora", "lora_rank": 4, "lora_max_rank": 8, "lora_energy": 0.9},
        "either --rank R (one rank for every module) or --max-rank R --energy E",
    ),
    ({"output_format": "lora"}, "--output-format lora needs --rank R"),
    ({"output_format": "lora", "lora_max_rank": 4}, "--max-rank needs --energy"),
    ({"output_format": "lora", "lora_energy": 0.9}, "--energy needs --max-rank"),
    ({"output_format": "lora", "lora_rank": 2.5}, "--rank must be an integer >= 1, got 2.5"),
    ({"output_format": "safetensors"}, "--output-format must be one of ['full', 'lora']"),
]


@pytest.mark.parametrize(("options", "message"), BAD_OPTIONS)
def test_bad_options_fail_before_any_work(tmp_path, options, message):
    base = _save_base(tmp_path / "base")
    _full_agent(base, tmp_path / "agent", {"model.norm.weight": torch.ones(32)})
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ConfigError) as caught:
        ram_trl.merge(_config(base, [tmp_path / "agent"]), tmp_path / "out", progress=False, **options)
    assert message in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_bad_cli_options_exit_2(tmp_path, capsys):
    base = _save_base(tmp_path / "base")
    _full_agent(base, tmp_path / "agent", {"model.norm.weight": torch.ones(32)})
    config = tmp_path / "merge.json"
    config.write_text(json.dumps(_config(base, [tmp_path / "agent"])))
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["merge", str(config), str(tmp_path / "out"), "--output-format", "lora", "--rank", "0"]) == 2
    assert "error: --rank must be an integer >= 1, got 0" in capsys.readouterr().err
    assert main(["merge", str(config), str(tmp_path / "out"), "--rank", "4"]) == 2
    assert "only to --output-format lora" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_an_existing_output_is_refused_before_merging(tmp_path):
    base = _save_base(tmp_path / "base")
    _full_agent(base, tmp_path / "agent", {"model.norm.weight": torch.ones(32)})
    (tmp_path / "out").mkdir()
    with pytest.raises(ram_trl.RamTrlError, match="already exists"):
        ram_trl.merge(_config(base, [tmp_path / "agent"]), tmp_path / "out", output_format="lora", lora_rank=2)
    assert list((tmp_path / "out").iterdir()) == [] and _leftovers(tmp_path) == []


def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch):
    base = _save_base(tmp_path / "base")
    _full_agent(base, tmp_path / "agent", {"model.norm.weight": torch.ones(32)})

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(lora_export, "_write_adapter", broken)
    with pytest.raises(OSError, match="disk full"):
        ram_trl.merge(
            _config(base, [tmp_path / "agent"]), tmp_path / "out", progress=False, output_format="lora", lora_rank=2
        )
    assert not (tmp_path / "out").exists()
    assert _leftovers(tmp_path) == []


def test_dry_run_plans_the_float32_merge_and_writes_nothing(tmp_path):
    base = _save_base(tmp_path / "base")
    _full_agent(base, tmp_path / "agent", {"model.norm.weight": torch.ones(32)})
    before = sorted(p.name for p in tmp_path.iterdir())
    summary = ram_trl.merge(
        _config(base, [tmp_path / "agent"], out_dtype="bfloat16"),
        tmp_path / "out",
        dry_run=True,
        output_format="lora",
        lora_max_rank=8,
        lora_energy=0.5,
    )
    assert summary["dry_run"] and summary["output_format"] == "lora"
    assert summary["lora_export"] == {"mode": "energy", "rank": None, "max_rank": 8, "energy": 0.5}
    assert summary["bytes_written"] == 4 * sum(v.numel() for v in load_file(str(base / "model.safetensors")).values())
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.slow
@pytest.mark.distributed
def test_distributed_export_equals_the_single_process_one(tmp_path):
    from tests.helpers import launch_merge

    base = _save_base(tmp_path / "base")
    g = torch.Generator().manual_seed(11)
    deltas = {
        "model.layers.0.self_attn.q_proj.weight": _low_rank((32, 32), [0.3, 0.2, 0.1], seed=9).float(),
        "model.layers.1.mlp.gate_proj.weight": torch.randn(64, 32, generator=g) * 0.01,
        "model.norm.weight": torch.randn(32, generator=g) * 0.1,
    }
    _full_agent(base, tmp_path / "agent", deltas)
    config = tmp_path / "merge.json"
    config.write_text(json.dumps(_config(base, [tmp_path / "agent"])))
    flags = ["--output-format", "lora", "--max-rank", "8", "--energy", "0.95"]
    result = launch_merge(2, config, tmp_path / "dist", *flags)
    assert result.returncode == 0, result.stderr[-3000:]
    assert main(["merge", str(config), str(tmp_path / "single"), "--no-progress", *flags]) == 0
    dist, single = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("dist", "single"))
    assert set(dist) == set(single)
    for key, value in single.items():
        torch.testing.assert_close(dist[key], value, rtol=1e-6, atol=1e-7, msg=key)
    configs = [json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("dist", "single")]
    assert configs[0] == configs[1]
    assert configs[0]["rank_pattern"]["model.layers.0.self_attn.q_proj"] == 3
    assert json.loads((tmp_path / "dist" / "ram_merge_report.json").read_text())["processes"] == 2
    assert _leftovers(tmp_path) == []
