"""How much of a merge survives its output dtype (ram_trl.statistics.effect): hand-computed tiny cases, the bf16
precision gate of issue 32 (three agents whose changed weights move by exactly one bf16 step), and the counts
against the written files of the merge without its step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ram_trl
from ram_trl.statistics.effect import block_effect, effect_line

STEP = 2.0**-7  # one bf16 step of values in [1, 2)
BF16 = torch.bfloat16


def _checkpoint(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True)
    save_file({k: v.to(BF16).contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return str(path)


def _merge(tmp_path, base, agents, method, params=None, **extra):
    config = {
        "merge_method": method,
        "base_model": base,
        "models": [{"model": a, "name": f"a{t}"} for t, a in enumerate(agents)],
        "parameters": params or {},
        **extra,
    }
    out = tmp_path / f"out-{method}-{len(list(tmp_path.iterdir()))}"
    report = ram_trl.merge(config, out, progress=False)
    return report, load_file(str(out / "model.safetensors"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Base 1.0 (4 elements, bf16); agent 0 moves e0, e1 one bf16 step, agent 1 moves e1, e2, e3."""
    root = tmp_path_factory.mktemp("tiny")
    base = torch.ones(4)
    return (
        _checkpoint(root / "base", {"w": base}),
        [
            _checkpoint(root / "a0", {"w": base + torch.tensor([STEP, STEP, 0, 0])}),
            _checkpoint(root / "a1", {"w": base + torch.tensor([0, STEP, STEP, STEP])}),
        ],
    )


def test_ram_plus_rescale_rounds_away_in_bf16_and_warns(tmp_path, tiny):
    # a0: unique 1, shared 1 -> rho 1, lambda 1.1; a1: unique 2, shared 1 -> rho 0.5, lambda 1.05. Unique elements
    # e0, e2, e3 are 1 + 1.1 s, 1 + 1.05 s in float32 (the step), both written 1 + s in bf16, as RAM writes them.
    report, written = _merge(tmp_path, *tiny, "ram_plus", {"r": 0.1})
    effect = report["effect"]
    assert (effect["changed"], effect["rounded_to_base"]) == (4, 0)
    assert (effect["step_elements"], effect["step_written"], effect["step_survival"]) == (3, 0, 0.0)
    assert effect["out_dtype"] == "bfloat16" and effect["step"] == "rescale (lambda_t)"
    assert effect["warning"] in report["warnings"]
    assert "float32" in effect["warning"] and "0.00%" in effect["warning"]
    _, ram = _merge(tmp_path, *tiny, "ram")
    assert torch.equal(written["w"].view(torch.int16), ram["w"].view(torch.int16))


def test_ram_plus_in_float32_keeps_the_rescale_and_does_not_warn(tmp_path, tiny):
    report, written = _merge(tmp_path, *tiny, "ram_plus", {"r": 0.1}, out_dtype="float32")
    effect = report["effect"]
    assert (effect["step_elements"], effect["step_written"]) == (3, 3)
    assert effect["step_survival"] == 1.0 and effect["step_written_share"] == 0.75
    assert effect["warning"] is None and not any("float32 to keep" in w for w in report["warnings"])
    expected = torch.tensor([1 + 1.1 * STEP, 1 + STEP, 1 + 1.05 * STEP, 1 + 1.05 * STEP])
    assert torch.allclose(written["w"], expected, rtol=0, atol=1e-7)


def test_rounded_to_base_and_lambda_step_are_counted_apart(tmp_path, tiny):
    # TA at lambda 0.25: e0, e2, e3 move s / 4, e1 s / 2 (a tie, rounded to the even 1.0): all four are written as
    # the base's 1.0. Without lambda (1) every element is written 1 + s or 1 + 2 s: the step survives everywhere.
    report, written = _merge(tmp_path, *tiny, "task_arithmetic", {"lambda": 0.25})
    effect = report["effect"]
    assert (effect["changed"], effect["rounded_to_base"], effect["rounded_to_base_share"]) == (4, 4, 1.0)
    assert (effect["step"], effect["step_elements"], effect["step_written"]) == ("lambda", 4, 4)
    assert torch.equal(written["w"], torch.ones(4, dtype=BF16))
    assert effect["warning"] is None
    assert "4 of 4 elements changed" in effect_line(effect) and "100.00% of them" in effect_line(effect)


def test_methods_without_a_step_report_no_step(tmp_path, tiny):
    for method, params in (("ram", {}), ("task_arithmetic", {"lambda": 1.0}), ("ties", {"density": 1.0})):
        effect = _merge(tmp_path, *tiny, method, params)[0]["effect"]
        assert "step" not in effect and effect["changed"] == 4, method


def test_block_effect_hand_computed():
    base = torch.tensor([1.0, 1.0, 2.0, 3.0])
    merged = torch.tensor([1.0, 1.001, 2.5, 3.0 + 2**-6])
    unstepped = torch.tensor([1.0, 1.002, 2.0, 3.0 + 2**-6])
    counts = block_effect(merged, merged.to(BF16), base, unstepped, BF16)
    # changed: e1, e2, e3; e1 (1.001) is written 1.0 in bf16. The step changes e1 (written 1.0 both ways) and e2.
    assert counts == {
        "numel": 4,
        "changed": 3,
        "delta_sq": pytest.approx(0.001**2 + 0.25 + 2**-12),
        "rounded_to_base": 1,
        "step_elements": 2,
        "step_written": 1,
    }
    assert "rounded_to_base" not in block_effect(merged, merged, base, None, torch.float32)


@pytest.fixture(scope="module")
def one_step_agents(tmp_path_factory):
    """Issue 32's case: a bf16 base in [1, 2) and three agents whose changed weights move exactly one bf16 step,
    densities 2.8%, 1.9% and 3.1%."""
    root = tmp_path_factory.mktemp("gate")
    g = torch.Generator().manual_seed(0)
    base = 1 + torch.randint(0, 127, (64, 256), generator=g).float() / 128
    agents = []
    for t, density in enumerate((0.028, 0.019, 0.031)):
        moved = torch.rand(base.shape, generator=g) < density
        agents.append(_checkpoint(root / f"a{t}", {"w": base + moved * STEP}))
    return _checkpoint(root / "base", {"w": base}), agents


def test_issue_32_ram_plus_in_bf16_is_ram_and_says_so(tmp_path, one_step_agents):
    report, written = _merge(tmp_path, *one_step_agents, "ram_plus", {"r": 0.1, "alpha": 2.0})
    _, ram = _merge(tmp_path, *one_step_agents, "ram")
    assert torch.equal(written["w"].view(torch.int16), ram["w"].view(torch.int16))  # byte-identical
    effect = report["effect"]
    assert effect["step_elements"] > 0.05 * effect["elements"]
    assert effect["step_written"] == 0 and effect["step_survival"] == 0.0
    assert sum("write out_dtype: float32 to keep it" in w for w in report["warnings"]) == 1


def test_issue_32_ram_plus_in_float32_differs_where_the_report_says(tmp_path, one_step_agents):
    report, written = _merge(tmp_path, *one_step_agents, "ram_plus", {"r": 0.1, "alpha": 2.0}, out_dtype="float32")
    _, ram = _merge(tmp_path, *one_step_agents, "ram", out_dtype="float32")
    differ = int((written["w"] != ram["w"]).sum())
    effect = report["effect"]
    assert differ == effect["step_written"] == effect["step_elements"] > 0.05 * effect["elements"]
    assert effect["step_survival"] == 1.0 and effect["warning"] is None


@pytest.mark.parametrize(
    ("method", "params", "without"),
    [
        ("ties", {"density": 0.01}, ("ties", {"density": 1.0})),
        ("dare_linear", {"density": 0.5}, ("task_arithmetic", {})),
        ("dare_ties", {"density": 0.5}, ("ties", {"density": 1.0, "normalize": False})),
        ("ram", {"unique_scale": 0.5}, ("ram", {})),
    ],
)
def test_step_written_counts_the_elements_the_merge_without_its_step_writes_differently(
    tmp_path, one_step_agents, method, params, without
):
    report, written = _merge(tmp_path, *one_step_agents, method, params)
    _, plain = _merge(tmp_path, *one_step_agents, *without)
    effect = report["effect"]
    assert effect["step_written"] == int((written["w"] != plain["w"]).sum())
    assert effect["step_elements"] >= effect["step_written"] > 0
