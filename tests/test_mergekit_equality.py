"""ram_trl against mergekit 0.1.5 itself: same checkpoints, same mergekit-style YAML, same output tensors.

mergekit runs in-process through its Python API (``MergeConfiguration.model_validate`` + ``run_merge``) on a tiny
Qwen2 model built from a config (no hub access). Both tools get ``dtype: float32``, so both compute in float32.

What is asserted:
- ``task_arithmetic`` and ``ties``: every output tensor is bit-identical (``torch.equal``), for several weights,
  ``lambda``, ``normalize``, densities, filter lists, 2 and 3 agents, with and without the base listed in
  ``models``, and with ram_trl streaming in small row chunks. TIES densities are chosen (and checked) so that
  mergekit's binary ``int(density * numel)`` equals ram_trl's exact decimal floor, and the task vectors have no
  magnitude ties at the cut (where the two tools' tie orders legitimately differ).
- ``ramplus_tl`` (mergekit's tensor-local RAM+, alpha 0.2): equal within ``rtol=1e-6, atol=1e-7`` but NOT
  bit-identical. Exact where no agent or exactly two agents are active; up to ~1 float32 ulp apart elsewhere,
  because mergekit (a) averages shared elements as ``sum_t(tau_t / c)`` while ram_trl computes ``sum_t(tau_t) / c``
  (different rounding when ``c`` is not a power of two, e.g. 3), and (b) computes
  ``lambda_t = 1 + r * clip(shared / unique, 0, alpha)`` in float32 tensor arithmetic while ram_trl computes it in
  float64 and rounds once to float32 (the two differ by one ulp for some count pairs, e.g. shared 16, unique 173).
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

with warnings.catch_warnings():
    # mergekit 0.1.5's lazy unpickler touches the deprecated numpy.core at import time
    warnings.simplefilter("ignore", DeprecationWarning)
    pytest.importorskip("mergekit", reason="mergekit is a test-only extra: pip install 'ram-trl[mergekit]'")
    from mergekit.config import MergeConfiguration
    from mergekit.merge import run_merge
    from mergekit.options import MergeOptions

import ram_trl  # noqa: E402
from ram_trl.merging.config.settings import interpolate  # noqa: E402
from ram_trl.methods.ties import keep_count  # noqa: E402

pytestmark = pytest.mark.filterwarnings(
    # Dense random task vectors trip ram_trl's "is it derived from this base?" warning; that is intended here.
    "ignore:.*of its elements differ from the base:UserWarning"
)

EPS = 1e-5


# ---------------------------------------------------------------------------------------------------------------
# Checkpoints


def _tiny_config(layers: int = 2) -> transformers.Qwen2Config:
    return transformers.Qwen2Config(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _save_agent(path: Path, tensors: dict[str, torch.Tensor], config: transformers.PretrainedConfig) -> None:
    path.mkdir()
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    config.save_pretrained(path)


def _has_magnitude_ties(base: torch.Tensor, agent: torch.Tensor) -> bool:
    """Whether two elements of the task vector have the same magnitude."""
    magnitudes = (agent - base).abs().reshape(-1)
    return torch.unique(magnitudes).numel() != magnitudes.numel()


def _build(root: Path, sparsity: list[float] | None, layers: int = 2) -> dict[str, Any]:
    """A tiny Qwen2 base and three agents derived from it.

    ``sparsity=None``: dense task vectors (every element moved; continuous values). Otherwise agent ``t`` moves
    each element with probability ``sparsity[t]`` (an RL-like sparse update), so elements are unchanged, unique to
    one agent, or shared.
    """
    config = _tiny_config(layers)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    base_dir = root / "base"
    model.save_pretrained(base_dir)
    base = load_file(str(base_dir / "model.safetensors"))
    agents = []
    for t in range(3):
        generator = torch.Generator().manual_seed(1000 + t)
        tensors = {}
        for name, value in base.items():
            for _attempt in range(20):
                noise = torch.randn(value.shape, generator=generator) * 0.01
                if sparsity is not None:
                    noise *= torch.rand(value.shape, generator=generator) < sparsity[t]
                tensors[name] = value + noise
                # The stored task vector is rounded to the ulps of the weights, so two elements can share a
                # magnitude; TIES would then cut them in an arbitrary (tool-specific) order. Redraw such tensors.
                if sparsity is not None or not _has_magnitude_ties(value, tensors[name]):
                    break
            else:
                raise AssertionError(f"{name}: could not draw a task vector without magnitude ties")
        path = root / f"agent{t}"
        _save_agent(path, tensors, config)
        agents.append(path)
    return {"base_dir": base_dir, "base": base, "agents": agents}


@pytest.fixture(scope="module")
def dense(tmp_path_factory) -> dict[str, Any]:
    return _build(tmp_path_factory.mktemp("dense"), None)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory) -> dict[str, Any]:
    return _build(tmp_path_factory.mktemp("sparse"), [0.3, 0.15, 0.08])


@pytest.fixture(scope="module")
def layered(tmp_path_factory) -> dict[str, Any]:
    """Dense task vectors on a 5-layer model (gradients interpolate between their anchors there), with a word-level
    tokenizer beside the base (for chat templates)."""
    ckpts = _build(tmp_path_factory.mktemp("layered"), None, layers=5)
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(60)} | {"<unk>": 60, "<s>": 61, "</s>": 62, "<|im_end|>": 63}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=words, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.save_pretrained(ckpts["base_dir"])
    return ckpts


# ---------------------------------------------------------------------------------------------------------------
# Running both tools


def _load_dir(path: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    assert files, f"no safetensors output in {path}"
    for file in files:
        part = load_file(str(file))
        assert not set(part) & set(tensors), f"{file}: tensor names repeated across shards"
        tensors.update(part)
    return tensors


def _config(
    ckpts: dict[str, Any],
    method: str,
    agent_params: list[dict[str, Any]],
    params: dict[str, Any] | None = None,
    base_in_models: bool = False,
) -> dict[str, Any]:
    models = [{"model": str(ckpts["base_dir"])}] if base_in_models else []
    models += [{"model": str(path), "parameters": p} for path, p in zip(ckpts["agents"], agent_params, strict=False)]
    return {
        "merge_method": method,
        "base_model": str(ckpts["base_dir"]),
        "models": models,
        "parameters": dict(params or {}),
        "dtype": "float32",
    }


def _run_both(
    config: dict[str, Any], tmp_path: Path, **ram_kwargs: Any
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(ram_trl's output, mergekit's output) for the same config dict."""
    theirs_dir, ours_dir = tmp_path / "mergekit", tmp_path / "ram_trl"
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(theirs_dir),
        options=MergeOptions(device="cpu", quiet=True, copy_tokenizer=False, write_model_card=False),
    )
    ram_trl.merge(copy.deepcopy(config), ours_dir, progress=False, **ram_kwargs)
    return _load_dir(ours_dir), _load_dir(theirs_dir)


def _check_common(
    ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], base: dict[str, torch.Tensor]
) -> None:
    assert set(ours) == set(theirs) == set(base)
    for name in base:
        assert ours[name].dtype == theirs[name].dtype == torch.float32, name
        assert ours[name].shape == theirs[name].shape == base[name].shape, name
    # Sanity: the merge did something, in both tools (else equality would prove nothing).
    for merged in (ours, theirs):
        moved = [name for name in base if not torch.equal(merged[name], base[name])]
        assert moved == list(base), f"tensors left equal to the base: {sorted(set(base) - set(moved))}"


def _assert_identical(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    diffs = {
        name: (int((ours[name] != theirs[name]).sum()), float((ours[name] - theirs[name]).abs().max()))
        for name in theirs
        if not torch.equal(ours[name], theirs[name])
    }
    assert not diffs, f"(unequal elements, max |diff|) per tensor: {diffs}"


# ---------------------------------------------------------------------------------------------------------------
# task_arithmetic and ties: bit-identical

TASK_ARITHMETIC_CASES = {
    "2 agents, weights, lambda": ([{"weight": 0.7}, {"weight": 0.3}], {"lambda": 0.6}, False),
    "3 agents, base listed in models": ([{"weight": 1.0}, {"weight": 0.45}, {"weight": -0.2}], {}, True),
    "3 agents, normalize, lambda": (
        [{"weight": 0.7}, {"weight": 0.3}, {"weight": 1.3}],
        {"lambda": 1.25, "normalize": True},
        True,
    ),
    "filter lists, int8_mask": (
        [{"weight": [{"filter": "mlp", "value": 0.25}, {"value": 0.8}]}, {"weight": 0.5}],
        {"lambda": 0.9, "int8_mask": True},
        False,
    ),
}


@pytest.mark.parametrize("case", list(TASK_ARITHMETIC_CASES))
def test_task_arithmetic_equals_mergekit(case, dense, tmp_path):
    agent_params, params, base_in_models = TASK_ARITHMETIC_CASES[case]
    config = _config(dense, "task_arithmetic", agent_params, params, base_in_models)
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, dense["base"])
    _assert_identical(ours, theirs)


TIES_CASES = {
    "2 agents, normalize (default)": ([{"weight": 0.7, "density": 0.5}, {"weight": 0.3, "density": 0.25}], {}, False),
    "2 agents, lambda, base listed": (
        [{"weight": 1.0, "density": 0.3}, {"weight": 1.0, "density": 0.7}],
        {"lambda": 0.8},
        True,
    ),
    "3 agents, normalize false, lambda": (
        [{"weight": 0.7, "density": 0.5}, {"weight": 0.3, "density": 0.25}, {"weight": 1.2, "density": 0.8}],
        {"normalize": False, "lambda": 1.5},
        True,
    ),
    "3 agents, normalize true, keep-all density": (
        [{"weight": 0.5, "density": 1.0}, {"weight": 1.5, "density": 0.1}, {"weight": 0.9, "density": 0.6}],
        {"normalize": True, "lambda": 0.7, "int8_mask": True},
        False,
    ),
    "3 agents, filter lists": (
        [
            {"weight": [{"filter": "self_attn", "value": 0.4}, {"value": 1.0}], "density": 0.5},
            {"weight": 0.8, "density": [{"filter": "mlp", "value": 0.2}, {"value": 0.6}]},
            {"weight": 0.6, "density": 0.4},
        ],
        {},
        True,
    ),
}


def _check_density_premise(config: dict[str, Any], base: dict[str, torch.Tensor]) -> None:
    """mergekit keeps max(1, int(density * numel)); ram_trl the exact decimal floor. The cases must not tell them apart."""
    for entry in config["models"]:
        density = entry.get("parameters", {}).get("density", 1.0)
        values = (
            [r["value"] for r in density] if isinstance(density, list) and isinstance(density[0], dict) else [density]
        )
        # gradients: every value they take on the layered fixture's 5 layers (and t = 0 outside them)
        values = [interpolate(v, i / 4) for v in values if isinstance(v, list) for i in range(5)] + [
            v for v in values if not isinstance(v, list)
        ]
        for value in values:
            for tensor in base.values():
                n = tensor.numel()
                theirs = n if value >= 1 else max(1, int(value * n))
                assert keep_count(n, value) == theirs, (value, n)


@pytest.mark.parametrize("case", list(TIES_CASES))
def test_ties_equals_mergekit(case, dense, tmp_path):
    agent_params, params, base_in_models = TIES_CASES[case]
    config = _config(dense, "ties", agent_params, params, base_in_models)
    _check_density_premise(config, dense["base"])
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, dense["base"])
    _assert_identical(ours, theirs)


def test_ties_streamed_in_small_chunks_equals_mergekit(dense, tmp_path):
    """Trimming carried across row chunks (a 2 KB chunk budget: a few rows at a time) changes nothing."""
    agent_params, params, base_in_models = TIES_CASES["3 agents, normalize false, lambda"]
    config = _config(dense, "ties", agent_params, params, base_in_models)
    ours, theirs = _run_both(config, tmp_path, chunk_budget=2048)
    _check_common(ours, theirs, dense["base"])
    _assert_identical(ours, theirs)


def test_ties_density_actually_trims(dense, tmp_path):
    """The TIES cases exercise trimming: with density 0.25 most of a tensor's elements stay at the base."""
    config = _config(dense, "ties", [{"weight": 1.0, "density": 0.25}, {"weight": 1.0, "density": 0.25}])
    ours, theirs = _run_both(config, tmp_path)
    _assert_identical(ours, theirs)
    name = "model.layers.0.mlp.down_proj.weight"
    moved = int((ours[name] != dense["base"][name]).sum())
    n = dense["base"][name].numel()
    # two agents keep 25% each: between 25% and 50% of the elements move
    assert n // 4 <= moved <= n // 2, (moved, n)


# ---------------------------------------------------------------------------------------------------------------
# ramplus_tl: the same maths, equal to ~1 float32 ulp (not bit-identical; see the module docstring)

RAMPLUS_TL_CASES = {
    "defaults (r 0.1, alpha 0.2), 3 agents": ([{}, {}, {}], {}, True),
    "r, alpha, epsilon, 2 agents": ([{}, {}], {"r": 0.3, "alpha": 0.5, "epsilon": 1e-5}, False),
    # 3 agents with rho below alpha: hits both rounding differences (means of 3, float32 vs float64 lambda)
    "r 0.3, alpha 2, 3 agents": ([{}, {}, {}], {"r": 0.3, "alpha": 2.0}, False),
}


def _active_counts(
    ckpts: dict[str, Any], num_agents: int, name: str, agents: dict[Path, dict[str, torch.Tensor]]
) -> torch.Tensor:
    taus = torch.stack([agents[p][name] - ckpts["base"][name] for p in ckpts["agents"][:num_agents]])
    return (taus.abs() > EPS).sum(dim=0)


@pytest.mark.parametrize("case", list(RAMPLUS_TL_CASES))
def test_ramplus_tl_matches_mergekit_to_float32_rounding(case, sparse, tmp_path):
    agent_params, params, base_in_models = RAMPLUS_TL_CASES[case]
    config = _config(sparse, "ramplus_tl", agent_params, params, base_in_models)
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, sparse["base"])

    agents = {p: load_file(str(p / "model.safetensors")) for p in sparse["agents"]}
    seen_counts = set()
    for name, base in sparse["base"].items():
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
        counts = _active_counts(sparse, len(agent_params), name, agents)
        seen_counts.update(counts.unique().tolist())
        # No agent active: both keep the base. Exactly two active: tau/2 sums are exact, so both agree bit for bit.
        exact = (counts == 0) | (counts == 2)
        assert torch.equal(ours[name][exact], theirs[name][exact]), name
        assert torch.equal(ours[name][counts == 0], base[counts == 0]), name
    # the fixture covers untouched, unique and shared elements
    assert {0, 1, 2} <= seen_counts


def test_ramplus_tl_is_tensor_local_in_both(sparse, tmp_path):
    """Sanity for the test above: ramplus_tl differs from global-rho ram_plus on these inputs (rho varies by tensor),
    so the agreement with mergekit is not an accident of identical lambdas everywhere."""
    config = _config(sparse, "ramplus_tl", [{}, {}, {}], {"r": 0.3, "alpha": 2.0})
    ours, theirs = _run_both(config, tmp_path)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
    global_config = _config(sparse, "ram_plus", [{}, {}, {}], {"r": 0.3, "alpha": 2.0})
    ram_trl.merge(global_config, tmp_path / "global", progress=False)
    global_rho = _load_dir(tmp_path / "global")
    differing = [name for name in theirs if not torch.equal(global_rho[name], ours[name])]
    assert differing, "tensor-local and global rho gave the same output: the fixture cannot tell them apart"
    assert math.isfinite(sum(float(t.abs().sum()) for t in ours.values()))


# ---------------------------------------------------------------------------------------------------------------
# slerp: bit-identical (mergekit's float32 operations, one by one)

SLERP_CASES = {
    "t 0.3": {"t": 0.3},
    "t per filter": {"t": [{"filter": "self_attn", "value": 0.2}, {"filter": "mlp", "value": 0.9}, {"value": 0.5}]},
    "t 0 (the base)": {"t": 0.0},
    "t 1 (the other model)": {"t": 1.0},
}


def _slerp_config(ckpts: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """mergekit's form: both models listed, base_model one of them (ram_trl leaves that entry out, with a note)."""
    return _config(ckpts, "slerp", [{}], params, base_in_models=True)


@pytest.mark.parametrize("case", list(SLERP_CASES))
def test_slerp_equals_mergekit(case, dense, tmp_path):
    config = _slerp_config(dense, SLERP_CASES[case])
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs) == set(dense["base"])
    _assert_identical(ours, theirs)
    if case == "t 0.3":
        _check_common(ours, theirs, dense["base"])


def test_slerp_streamed_in_small_chunks_equals_mergekit(dense, tmp_path):
    """The angle is found on whole tensors; merging them a few rows at a time changes nothing."""
    config = _slerp_config(dense, SLERP_CASES["t per filter"])
    ours, theirs = _run_both(config, tmp_path, chunk_budget=2048)
    _assert_identical(ours, theirs)


def test_slerp_takes_both_branches(dense):
    """The fixture has spherical tensors (random weights moved by noise) and nearly parallel ones (norm weights,
    all ones moved by 1e-2 noise, |cos| > 0.9995): both of mergekit's branches are compared above."""
    from ram_trl.methods.slerp import DOT_THRESHOLD

    agent = load_file(str(dense["agents"][0] / "model.safetensors"))
    cosines = [
        float(torch.nn.functional.cosine_similarity(base.reshape(1, -1), agent[name].reshape(1, -1)))
        for name, base in dense["base"].items()
    ]
    assert any(abs(c) > DOT_THRESHOLD for c in cosines) and any(abs(c) <= DOT_THRESHOLD for c in cosines)


# ---------------------------------------------------------------------------------------------------------------
# breadcrumbs, breadcrumbs_ties: bit-identical where the cuts are unambiguous (no magnitude ties, see TIES)

BREADCRUMBS_CASES = {
    "breadcrumbs, 2 agents": (
        "breadcrumbs",
        [{"weight": 0.7, "density": 0.5, "gamma": 0.1}, {"weight": 0.3, "density": 0.25}],
        {},
        False,
    ),
    "breadcrumbs, 3 agents, normalize, lambda, rescale": (
        "breadcrumbs",
        [
            {"weight": 1.0, "density": 0.5, "gamma": 0.2},
            {"weight": 0.45, "density": 0.75, "gamma": 0.25},
            {"weight": 0.6, "density": 0.3},
        ],
        {"normalize": True, "lambda": 0.8, "rescale": True},
        True,
    ),
    "breadcrumbs_ties, 3 agents, filter lists": (
        "breadcrumbs_ties",
        [
            {"weight": [{"filter": "self_attn", "value": 0.4}, {"value": 1.0}], "density": 0.5, "gamma": 0.05},
            {"weight": 0.8, "density": [{"filter": "mlp", "value": 0.25}, {"value": 0.6}], "gamma": 0.1},
            {"weight": 0.6, "density": 0.4, "gamma": 0.5},
        ],
        {},
        True,
    ),
    "breadcrumbs_ties, normalize, rescale, density 1": (
        "breadcrumbs_ties",
        [{"weight": 0.5, "density": 1.0}, {"weight": 1.5, "density": 0.5, "gamma": 0.125}],
        {"normalize": True, "rescale": True, "lambda": 1.25},
        False,
    ),
}


def _check_breadcrumbs_premise(config: dict[str, Any], base: dict[str, torch.Tensor]) -> None:
    """mergekit counts int(density * n) and int(gamma * n); ram_trl the exact decimal floors. The cases must not tell
    them apart."""
    from ram_trl.methods.breadcrumbs import floor_count

    for entry in config["models"]:
        for key in ("density", "gamma"):
            value = entry.get("parameters", {}).get(key)
            if value is None:
                continue
            for v in [r["value"] for r in value] if isinstance(value, list) else [value]:
                for tensor in base.values():
                    n = tensor.numel()
                    assert floor_count(n, v) == (n if v >= 1 else int(v * n)), (key, v, n)


@pytest.mark.parametrize("case", list(BREADCRUMBS_CASES))
def test_breadcrumbs_equals_mergekit(case, dense, tmp_path):
    method, agent_params, params, base_in_models = BREADCRUMBS_CASES[case]
    config = _config(dense, method, agent_params, params, base_in_models)
    _check_breadcrumbs_premise(config, dense["base"])
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, dense["base"])
    _assert_identical(ours, theirs)


def test_breadcrumbs_streamed_in_small_chunks_equals_mergekit(dense, tmp_path):
    """Both cuts carried across row chunks (a 2 KB chunk budget) change nothing."""
    method, agent_params, params, base_in_models = BREADCRUMBS_CASES["breadcrumbs_ties, 3 agents, filter lists"]
    config = _config(dense, method, agent_params, params, base_in_models)
    ours, theirs = _run_both(config, tmp_path, chunk_budget=2048)
    _assert_identical(ours, theirs)


# ---------------------------------------------------------------------------------------------------------------
# model_stock: bit-identical (mergekit's float32 operations, one by one)

MODEL_STOCK_CASES = {
    "2 agents": (2, {}, False),
    "3 agents, base listed": (3, {}, True),
    "3 agents, filter_wise": (3, {"filter_wise": True}, False),
}


@pytest.mark.parametrize("case", list(MODEL_STOCK_CASES))
def test_model_stock_equals_mergekit(case, dense, tmp_path):
    count, params, base_in_models = MODEL_STOCK_CASES[case]
    config = _config(dense, "model_stock", [{}] * count, params, base_in_models)
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, dense["base"])
    _assert_identical(ours, theirs)


def test_model_stock_streamed_in_small_chunks_equals_mergekit(dense, tmp_path):
    """Per-row factors (filter_wise) picked by each row chunk change nothing."""
    config = _config(dense, "model_stock", [{}] * 3, {"filter_wise": True})
    ours, theirs = _run_both(config, tmp_path, chunk_budget=2048)
    _assert_identical(ours, theirs)


# ---------------------------------------------------------------------------------------------------------------
# della, della_linear: random drops (ram_trl's hash, mergekit's torch.bernoulli), so equal in distribution only


@pytest.mark.parametrize("method", ["della_linear", "della"])
def test_della_matches_mergekit_in_distribution(method, dense, tmp_path):
    """Both tools keep about ``density`` of each tensor's elements, larger magnitudes more often (p from
    density - epsilon to density + epsilon by rank), and rescale the survivors to the task vector's L1 norm."""
    config = _config(dense, method, [{"weight": 1.0, "density": 0.5, "epsilon": 0.2}], {})
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, dense["base"])
    agent = load_file(str(dense["agents"][0] / "model.safetensors"))
    checked = 0
    for name, base in dense["base"].items():
        tau = agent[name] - base
        if tau.numel() < 512:
            continue  # too few elements for the shares below
        checked += 1
        big = tau.abs() >= tau.abs().median()
        for merged in (ours, theirs):
            kept = (merged[name] - base) != 0
            assert abs(float(kept.float().mean()) - 0.5) < 0.05, name
            # the larger half of the magnitudes survives more often (expected shares 0.6 and 0.4)
            assert float(kept[big].float().mean()) > float(kept[~big].float().mean()) + 0.1, name
            l1 = float((merged[name] - base).abs().sum())
            assert l1 == pytest.approx(float(tau.abs().sum()), rel=1e-3), name
    assert checked >= 4


# ---------------------------------------------------------------------------------------------------------------
# The config surface: gradients, whole-model slices, unused per-model parameters, chat templates

GRADIENT_CASES = {
    "per-model weight gradients, global lambda gradient": (
        [{"weight": [0.2, 1.0, 0.4]}, {"weight": [1, 0.5, 0.7, 0.3, 0]}],
        {"lambda": [1.0, 0.5]},
    ),
    "gradients inside filter rules, falling through to the global rule": (
        [{"weight": [{"filter": "self_attn", "value": [0.0, 0.5, 0.3, 0.7, 1.0]}]}, {"weight": 0.5}],
        {"weight": [{"filter": "mlp", "value": [1.0, 0.25]}, {"value": 0.8}], "lambda": 0.9},
    ),
}


@pytest.mark.parametrize("case", list(GRADIENT_CASES))
def test_gradients_equal_mergekit(case, layered, tmp_path):
    agent_params, params = GRADIENT_CASES[case]
    config = _config(layered, "task_arithmetic", agent_params, params)
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, layered["base"])
    _assert_identical(ours, theirs)


def test_gradient_positions_equal_mergekits_evaluation(layered):
    """ram_trl's interpolation against mergekit's own ``evaluate_setting`` at every layer of 1 to 40, for uneven
    anchor counts (the rounding of ``t`` and of the mix is mergekit's, bit for bit)."""
    from mergekit.config import evaluate_setting

    from ram_trl.merging.config.settings import interpolate

    anchors = [0.1, 0.9, 0.35, 0.7, 0.05, 1.0, 0.3]
    for count in (1, 2, 3, 5, 7):
        for layers in range(1, 41):
            for i in range(layers):
                t = i / (layers - 1) if layers > 1 else 1.0
                theirs = evaluate_setting("x", anchors[:count], t, validate=float)
                assert interpolate(anchors[:count], t) == theirs, (count, layers, i)


def test_lazymergekit_slerp_slices_equal_mergekit(layered, tmp_path):
    """The most published form: whole-model ``slices`` and ``t`` gradients per filter."""
    base, other = str(layered["base_dir"]), str(layered["agents"][0])
    config = {
        "slices": [{"sources": [{"model": base, "layer_range": [0, 5]}, {"model": other, "layer_range": [0, 5]}]}],
        "merge_method": "slerp",
        "base_model": base,
        "parameters": {
            "t": [
                {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
                {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
                {"value": 0.5},
            ]
        },
        "dtype": "float32",
    }
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs) == set(layered["base"])
    _assert_identical(ours, theirs)
    # the gradient reached the layers: layer 0's attention is the base (t = 0), layer 4's the other model (t = 1)
    other_tensors = load_file(str(layered["agents"][0] / "model.safetensors"))
    name = "model.layers.{}.self_attn.q_proj.weight"
    assert torch.equal(ours[name.format(0)], layered["base"][name.format(0)])
    assert torch.equal(ours[name.format(4)], other_tensors[name.format(4)])


def _consecutive_slices(ckpts: dict[str, Any], cuts: list[int], sources: list[list[dict[str, Any]]]) -> list:
    """Output slices over the layer ranges between ``cuts``, each taking the base and the agents (each source's
    parameters from ``sources[slice][agent]``)."""
    base = str(ckpts["base_dir"])
    return [
        {
            "sources": [{"model": base, "layer_range": [lo, hi]}]
            + [
                {"model": str(path), "layer_range": [lo, hi], "parameters": p}
                for path, p in zip(ckpts["agents"], own, strict=False)
            ]
        }
        for lo, hi, own in zip(cuts[:-1], cuts[1:], sources, strict=True)
    ]


def test_consecutive_slices_with_their_own_gradients_equal_mergekit(layered, tmp_path):
    """Three slices over the five layers (2 + 1 + 2), each with its own parameters and gradients: mergekit restarts
    each gradient over its slice's layers and gives the embeddings the first slice's settings, the final norm and
    ``lm_head`` the last's."""
    slices = _consecutive_slices(
        layered,
        [0, 2, 3, 5],
        [
            [{"weight": [0.2, 1.0]}, {"weight": 0.5}],
            [{"weight": 0.8}, {"weight": [{"filter": "mlp", "value": [0.1, 0.9]}, {"value": 0.3}]}],
            [{"weight": [1.0, 0.4, 0.6]}, {}],
        ],
    )
    slices[1]["parameters"] = {"lambda": 0.7}
    slices[2]["parameters"] = {"lambda": [1.2, 0.6], "weight": -0.25}
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(layered["base_dir"]),
        "slices": slices,
        "parameters": {"lambda": [0.9, 1.1]},
        "dtype": "float32",
    }
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, layered["base"])
    _assert_identical(ours, theirs)
    # the slices' settings reached their layers: layer 2 alone in its slice (t = 1), lambda 0.7 there
    whole = _config(layered, "task_arithmetic", [{"weight": 0.8}, {"weight": 0.9}], {"lambda": 0.7})
    reference = _run_both(whole, tmp_path / "whole")[0]
    name = "model.layers.2.mlp.up_proj.weight"
    assert torch.equal(ours[name], reference[name])
    assert not torch.equal(ours["model.layers.1." + name[15:]], reference["model.layers.1." + name[15:]])


def test_consecutive_slerp_slices_equal_mergekit(layered, tmp_path):
    """The published per-slice slerp form: each slice its own ``t`` gradient per filter."""
    base, other = str(layered["base_dir"]), str(layered["agents"][0])
    config = {
        "slices": [
            {"sources": [{"model": base, "layer_range": [0, 3]}, {"model": other, "layer_range": [0, 3]}]},
            {
                "sources": [{"model": base, "layer_range": [3, 5]}, {"model": other, "layer_range": [3, 5]}],
                "parameters": {"t": [{"filter": "self_attn", "value": [0.9, 0.2]}, {"value": 0.6}]},
            },
        ],
        "merge_method": "slerp",
        "base_model": base,
        "parameters": {"t": [{"filter": "mlp", "value": [1, 0.5, 0]}, {"value": 0.3}]},
        "dtype": "float32",
    }
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs) == set(layered["base"])
    _assert_identical(ours, theirs)


@pytest.mark.parametrize("method", ["slerp", "model_stock", "ramplus_tl"])
def test_unused_per_model_weights_are_ignored_as_in_mergekit(method, layered, tmp_path):
    """mergekit's own test configs give every model a ``weight`` (0.6, 0.4), whatever the method."""
    agents = layered["agents"][: 1 if method == "slerp" else 2]
    config = {
        "merge_method": method,
        "base_model": str(layered["base_dir"]),
        "models": [{"model": str(p), "parameters": {"weight": w}} for p, w in zip(agents, [0.6, 0.4], strict=False)],
        "parameters": {"t": 0.35} if method == "slerp" else {},
        "dtype": "float32",
    }
    if method == "slerp":
        config["models"].insert(0, {"model": str(layered["base_dir"]), "parameters": {"weight": 0.6}})
    with pytest.warns(UserWarning, match="does not use the parameter"):
        ours, theirs = _run_both(config, tmp_path)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize(
    "template", ["chatml", "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"]
)
def test_chat_template_equals_mergekits(template, layered, tmp_path):
    config = {**_config(layered, "task_arithmetic", [{"weight": 0.5}, {"weight": 0.5}]), "chat_template": template}
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(tmp_path / "mergekit"),
        options=MergeOptions(device="cpu", quiet=True, write_model_card=False),
    )
    ram_trl.merge(copy.deepcopy(config), tmp_path / "ram_trl", progress=False)
    messages = [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]
    rendered = [
        transformers.AutoTokenizer.from_pretrained(tmp_path / tool).apply_chat_template(messages, tokenize=False)
        for tool in ("ram_trl", "mergekit")
    ]
    assert rendered[0] == rendered[1]
    assert ("<|im_start|>user" if template == "chatml" else "[user] w1 w2") in rendered[0]


# ---------------------------------------------------------------------------------------------------------------
# sce: bit-identical (mergekit's float32 operations; the variances at the cut are distinct on these inputs)

SCE_CASES = {
    "select_topk 1 (no selection), 2 agents": ([{}, {}], {}),
    "select_topk 0.5, 3 agents": ([{}, {}, {}], {"select_topk": 0.5}),
    "select_topk gradient, int8_mask": ([{}, {}, {}], {"select_topk": [0.2, 0.9], "int8_mask": True}),
}


@pytest.mark.parametrize("case", list(SCE_CASES))
def test_sce_equals_mergekit(case, layered, tmp_path):
    agent_params, params = SCE_CASES[case]
    config = _config(layered, "sce", agent_params, params)
    ours, theirs = _run_both(config, tmp_path)
    _check_common(ours, theirs, layered["base"])
    _assert_identical(ours, theirs)


def test_model_plus_lora_reference_equals_mergekit(tmp_path):
    """mergekit's ``BASE+ADAPTER``: mergekit merges the adapter into the base first (peft, float32), ram_trl reads
    the adapter as a LoRA agent; the same task vector up to the rounding of ``base + B @ A``."""
    from tests.helpers import lora_adapter, qwen_model, save_base

    base_dir = save_base(qwen_model(seed=0), tmp_path / "base")
    lora_adapter(qwen_model(seed=0), tmp_path / "adapter", seed=3, r=4, target_modules=["q_proj", "v_proj"])
    config = {
        "merge_method": "task_arithmetic",
        "base_model": str(base_dir),
        "models": [{"model": f"{base_dir}+{tmp_path / 'adapter'}", "parameters": {"weight": 0.5}}],
        "dtype": "float32",
    }
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(tmp_path / "mergekit"),
        options=MergeOptions(
            device="cpu",
            quiet=True,
            copy_tokenizer=False,
            write_model_card=False,
            lora_merge_cache=str(tmp_path / "c"),
        ),
    )
    ram_trl.merge(copy.deepcopy(config), tmp_path / "ram_trl", progress=False)
    ours, theirs = _load_dir(tmp_path / "ram_trl"), _load_dir(tmp_path / "mergekit")
    base = _load_dir(base_dir)
    assert set(ours) == set(theirs)
    moved = [name for name in theirs if not torch.equal(theirs[name], base[name])]
    assert moved and all("q_proj" in name or "v_proj" in name for name in moved)
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)


def test_model_plus_lora_as_base_and_on_another_model_equals_mergekit(tmp_path, monkeypatch):
    """mergekit's LoRA syntax where a full model goes: a base written ``MODEL+ADAPTER`` and an agent that is an
    adapter on another model than the base are merged into their models as mergekit merges them (PEFT's
    merge_and_unload): the outputs are bit-identical (ram_trl 0.x refused both)."""
    import tempfile

    from tests.helpers import lora_adapter, qwen_model, save_base

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the merged models go under tmp_path
    base_dir = save_base(qwen_model(seed=0), tmp_path / "base")
    lora_adapter(qwen_model(seed=0), tmp_path / "adapter", seed=3, r=4, target_modules=["q_proj", "v_proj"])
    lora_adapter(qwen_model(seed=0), tmp_path / "adapter2", seed=5, r=2, target_modules=["k_proj", "up_proj"])
    agent = qwen_model(seed=0)
    with torch.no_grad():
        for k, parameter in enumerate(agent.parameters()):
            parameter.add_(0.01 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(k)))
    agent_dir = save_base(agent, tmp_path / "agent")
    config = {
        "merge_method": "task_arithmetic",
        "base_model": f"{base_dir}+{tmp_path / 'adapter'}",
        "models": [
            {"model": str(agent_dir), "parameters": {"weight": 0.5}},
            {"model": f"{agent_dir}+{tmp_path / 'adapter2'}", "parameters": {"weight": 0.3}},
        ],
        "dtype": "float32",
    }
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(tmp_path / "mergekit"),
        options=MergeOptions(
            device="cpu",
            quiet=True,
            copy_tokenizer=False,
            write_model_card=False,
            lora_merge_cache=str(tmp_path / "c"),
        ),
    )
    report = ram_trl.merge(copy.deepcopy(config), tmp_path / "ram_trl", progress=False)
    assert [a["kind"] for a in report["agents"]] == ["full", "full"]
    ours, theirs = _load_dir(tmp_path / "ram_trl"), _load_dir(tmp_path / "mergekit")
    base = _load_dir(base_dir)
    _assert_identical(ours, theirs)
    # the adapters were applied: the merged base's q_proj and the second agent's k_proj differ from their models'
    merged_base, merged_agent = Path(report["base_model"]), Path(report["agents"][1]["path"])
    assert merged_base.parent.parent == merged_agent.parent.parent == tmp_path  # kept under the temporary directory
    for merged, plain, module in [(merged_base, base, "q_proj"), (merged_agent, _load_dir(agent_dir), "k_proj")]:
        changed = _load_dir(merged)
        assert all(not torch.equal(changed[n], plain[n]) for n in plain if f"{module}.weight" in n)
        assert all(torch.equal(changed[n], plain[n]) for n in plain if "o_proj" in n)


# ---------------------------------------------------------------------------------------------------------------
# The configs of mergekit's tests/test_tokenizer.py and test_chat_template.py (tiny Llamas, bf16, weight 1.0 on every
# model, a global `embed_slerp` that linear does not use)


def _pico(path: Path, vocab: int, added: list[str], seed: int) -> str:
    """A tiny Llama with a 64-token BPE tokenizer plus ``added`` tokens (mergekit's test models)."""
    import json
    import tempfile

    import tokenizers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_attention_heads=16, num_hidden_layers=2
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    words = ["<unk>", "<s>", "</s>"] + [f"_tok_{i}" for i in range(3, 64)]
    spec = {
        "version": "1.0",
        "model": {"type": "BPE", "vocab": dict(zip(words, range(64), strict=True)), "merges": []},
    }
    with tempfile.TemporaryDirectory() as scratch:
        tokenizers.Tokenizer.from_str(json.dumps({**spec, "added_tokens": []})).save(f"{scratch}/tokenizer.json")
        tokenizer = transformers.LlamaTokenizerFast(tokenizer_file=f"{scratch}/tokenizer.json")
    tokenizer.add_tokens(added)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def picollamas(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("picollama")
    return {
        "base": _pico(root / "base", 64, [], 0),
        "padded": _pico(root / "padded", 64, [f"<UNUSED_{i}>" for i in range(4)], 1),
        "chatml": _pico(root / "chatml", 66, ["<|im_start|>", "<|im_end|>"], 2),
        # the same two chat tokens, numbered the other way round
        "swapped": _pico(root / "swapped", 66, ["<|im_end|>", "<|im_start|>"], 3),
        # the same two chat tokens, numbered alike, with rows of its own
        "chatml2": _pico(root / "chatml2", 66, ["<|im_start|>", "<|im_end|>"], 5),
        # embeddings with rows past their tokenizers: two spare rows, and the chatml tokens plus one spare row
        "spare": _pico(root / "spare", 66, [], 6),
        "wide": _pico(root / "wide", 67, ["<|im_start|>", "<|im_end|>"], 7),
    }


def _tokenizer_config(models: dict[str, str], names: list[str], **extra: Any) -> dict[str, Any]:
    method = extra.pop("merge_method", "linear")
    return {
        "merge_method": method,
        "base_model": models["base"],
        "models": [{"model": models[n], "parameters": {"weight": 1.0}} for n in names],
        "dtype": "bfloat16",
        "parameters": {"embed_slerp": False, **extra.pop("parameters", {})},
        **extra,
    }


@pytest.mark.filterwarnings("ignore:.*does not use the parameter:UserWarning")
@pytest.mark.filterwarnings("ignore:.*task vector is zero:UserWarning")
@pytest.mark.parametrize(
    ("names", "extra"),
    [
        (["base", "padded"], {}),
        (["base", "padded"], {"tokenizer_source": "base"}),
        (["base", "padded", "chatml"], {"tokenizer_source": "base"}),
        (["base", "padded", "chatml"], {"tokenizer_source": "union"}),
        # two models add the rows: built in every model before the merge, their mean summed in bf16 as mergekit
        (["base", "chatml", "chatml2"], {"tokenizer_source": "union"}),
    ],
)
def test_mergekit_tokenizer_configs_equal_mergekit(names, extra, picollamas, tmp_path):
    """test_legacy_mode, test_source_base, test_source_union: the models' tokenizers number the
    tokens alike (the chatml model adds two rows; the padded model's four added tokens have no rows). The base's
    tokenizer leaves the added rows out; the union keeps the chatml model's (its tokenizer is the union). The same
    tensors as mergekit's (bf16 rounding apart: ram_trl computes in float32) and the same vocabulary."""
    config = _tokenizer_config(picollamas, names, **extra)
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(tmp_path / "mergekit"),
        options=MergeOptions(device="cpu", quiet=True, write_model_card=False),
    )
    ram_trl.merge(copy.deepcopy(config), tmp_path / "ram_trl", progress=False)
    ours, theirs = _load_dir(tmp_path / "ram_trl"), _load_dir(tmp_path / "mergekit")
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].dtype == theirs[name].dtype == torch.bfloat16
        # one bf16 step of the inputs' scale apart at most (mergekit sums in bf16, cancellations included)
        torch.testing.assert_close(ours[name].float(), theirs[name].float(), rtol=2**-7, atol=2e-4, msg=name)
    assert not torch.equal(ours["lm_head.weight"], _load_dir(Path(picollamas["base"]))["lm_head.weight"])
    vocabularies = [
        transformers.AutoTokenizer.from_pretrained(tmp_path / tool).get_vocab() for tool in ("ram_trl", "mergekit")
    ]
    size = 66 if extra.get("tokenizer_source") == "union" else 64
    assert vocabularies[0] == vocabularies[1] and len(vocabularies[0]) == size
    assert ours["lm_head.weight"].shape[0] == size
    if size == 66 and "chatml2" not in names:  # the added tokens' rows are the chatml model's (rounded to bf16)
        chatml = _load_dir(Path(picollamas["chatml"]))
        for name in ("lm_head.weight", "model.embed_tokens.weight"):
            donor = chatml[name][64:].to(torch.bfloat16)
            assert torch.equal(ours[name][64:], donor) and torch.equal(theirs[name][64:], donor), name


def _token_rules(models: dict[str, str]) -> dict[str, Any]:
    return {
        "<|im_start|>": {"source": models["chatml2"]},  # lacking in the base: chatml2's row, not the mean
        "<|im_end|>": {"source": {"kind": "zero"}},
        "_tok_7": {"source": models["chatml"], "force": True},  # every model: chatml's row
        "_tok_9": {"source": {"kind": "model_token", "model": models["base"], "token": "_tok_3"}, "force": True},
        "_tok_11": {"source": {"kind": "model_token", "model": models["chatml2"], "token_id": 65}},  # no effect
    }


UNION_ROW_CASES = {
    # test_slerp_union: the added rows enter SLERP's angle (the base gets the chatml model's rows)
    "slerp, one model adds the rows": (["chatml"], "slerp", [{}], {"t": 0.5}),
    "task_arithmetic, two models add the rows, unequal weights": (
        ["chatml", "chatml2"],
        "task_arithmetic",
        [{"weight": 0.3}, {"weight": 0.9}],
        {"lambda": 0.8},
    ),
    "ties, two models add the rows, density": (
        ["chatml", "chatml2"],
        "ties",
        [{"weight": 0.3, "density": 0.5}, {"weight": 0.9, "density": 0.7}],
        {},
    ),
    "tokens rules: sources, zero, model_token, force": (
        ["chatml", "chatml2"],
        "task_arithmetic",
        [{"weight": 0.3}, {"weight": 0.9}],
        {},
    ),
    # tensor-local RAM+ counts the rows the two models add (the base's: their mean) like any others
    "ramplus_tl, two models add the rows": (["chatml", "chatml2"], "ramplus_tl", [{}, {}], {}),
    "ties, the padded model lacks the rows": (
        ["padded", "chatml"],
        "ties",
        [{"weight": 1.0, "density": 0.5}, {"weight": 0.6, "density": 0.5}],
        {},
    ),
}


@pytest.mark.parametrize("case", list(UNION_ROW_CASES))
def test_union_rows_built_before_the_merge_equal_mergekit(case, picollamas, tmp_path):
    """Where the added tokens' rows enter a whole-tensor step, or come from several models, every model gets
    mergekit's rows for them before the merge (the only holder's row, else the holders' mean): the same tensors,
    the same vocabulary and ``vocab_size``."""
    names, method, agent_params, params = UNION_ROW_CASES[case]
    config = {
        "merge_method": method,
        "base_model": picollamas["base"],
        "models": [{"model": picollamas[n], "parameters": p} for n, p in zip(names, agent_params, strict=True)],
        "parameters": params,
        "tokenizer_source": "union",
        "dtype": "float32",
    }
    if case.startswith("tokens rules"):
        del config["tokenizer_source"]
        config["tokenizer"] = {"tokens": _token_rules(picollamas)}
    theirs_dir, ours_dir = tmp_path / "mergekit", tmp_path / "ram_trl"
    run_merge(
        MergeConfiguration.model_validate(copy.deepcopy(config)),
        str(theirs_dir),
        options=MergeOptions(device="cpu", quiet=True, write_model_card=False),
    )
    ram_trl.merge(copy.deepcopy(config), ours_dir, progress=False)
    ours, theirs = _load_dir(ours_dir), _load_dir(theirs_dir)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
    assert ours["lm_head.weight"].shape[0] == 66
    vocabularies = [transformers.AutoTokenizer.from_pretrained(d).get_vocab() for d in (ours_dir, theirs_dir)]
    assert vocabularies[0] == vocabularies[1] and len(vocabularies[0]) == 66
    configs = [json.loads((d / "config.json").read_text())["vocab_size"] for d in (ours_dir, theirs_dir)]
    assert configs == [66, 66]
    if case.startswith("tokens rules"):
        lm_head = {n: _load_dir(Path(picollamas[n]))["lm_head.weight"] for n in ("base", "chatml")}
        assert torch.equal(ours["lm_head.weight"][7], lm_head["chatml"][7])
        assert torch.equal(ours["lm_head.weight"][9], lm_head["base"][3])
    elif method == "task_arithmetic":
        # the rows two models add: not their plain mean (mergekit merges them from it, with the unequal weights)
        rows = [_load_dir(Path(picollamas[n]))["lm_head.weight"][64:] for n in names]
        assert not torch.allclose(ours["lm_head.weight"][64:], (rows[0] + rows[1]) / 2, atol=1e-4)


@pytest.mark.parametrize(("names", "rows"), [(["spare", "chatml"], 66), (["wide"], 66), (["spare"], 64)])
def test_union_leaves_out_rows_past_a_models_tokenizer_as_mergekit(names, rows, picollamas, tmp_path):
    """A model whose embedding has rows that are no token of its tokenizer: mergekit's union leaves them out (the
    output has one row per union token) and gives the model the default row for a token it lacks, so its spare rows
    never enter a merged row (ram_trl wrote 67 rows for ``wide`` and mixed ``spare``'s rows 64-65 into the chat
    tokens' rows, 0.04 off)."""
    config = {
        "merge_method": "task_arithmetic",
        "base_model": picollamas["base"],
        "models": [{"model": picollamas[n], "parameters": {"weight": 0.6}} for n in names],
        "tokenizer_source": "union",
        "dtype": "float32",
    }
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
    assert ours["lm_head.weight"].shape[0] == rows
    configs = [json.loads((tmp_path / d / "config.json").read_text())["vocab_size"] for d in ("ram_trl", "mergekit")]
    assert configs == [rows, rows]


@pytest.mark.parametrize(("method", "source"), [("task_arithmetic", None), ("ties", None), ("ties", "base")])
def test_union_padded_to_a_multiple_equals_mergekit(method, source, picollamas, tmp_path):
    """``tokenizer.pad_to_multiple_of``: the 66-token union (or the base's 64 tokens, the chatml model's two added
    rows left out) padded to 96 rows, each model's padding rows the mean of its vocabulary rows (the base's rows for
    the added tokens: the chatml model's) before the merge."""
    config = {
        "merge_method": method,
        "base_model": picollamas["base"],
        "models": [
            # density 1: the padding rows repeat one value per model, so TIES' cut would fall among equal
            # magnitudes there, where the tools' documented tie rules differ
            {"model": picollamas["chatml"], "parameters": {"weight": 0.7, "density": 1.0}},
            {"model": picollamas["padded"], "parameters": {"weight": 0.4, "density": 1.0}},
        ],
        "tokenizer": {"pad_to_multiple_of": 32 if source is None else 48},
        "dtype": "float32",
    }
    if source is not None:
        config["tokenizer"]["source"] = source
    if method == "task_arithmetic":
        for entry in config["models"]:
            del entry["parameters"]["density"]
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
    assert ours["lm_head.weight"].shape[0] == 96
    assert json.loads((tmp_path / "ram_trl" / "config.json").read_text())["vocab_size"] == 96
    assert torch.equal(ours["lm_head.weight"][66], ours["lm_head.weight"][95])
    if source == "base":  # row 64 is padding (the chatml model's token is not in the base's tokenizer)
        assert torch.equal(ours["lm_head.weight"][64], ours["lm_head.weight"][95])


@pytest.mark.filterwarnings("ignore:.*does not use the parameter:UserWarning")
@pytest.mark.filterwarnings("ignore:.*task vector is zero:UserWarning")
@pytest.mark.parametrize(
    "extra",
    [
        {"tokenizer_source": "union", "merge_method": "ties", "parameters": {"density": 0.5}},
        {"tokenizer": {"source": "union", "tokens": {"_tok_5": {"source": "base"}, "</s>": {}}}},
    ],
)
def test_union_rules_mergekit_never_applies_equal_mergekit(extra, picollamas, tmp_path):
    """A union that adds no rows (the padded model's tokens have none) with a whole-tensor step (TIES' cut), and
    token rules for tokens every model holds (mergekit builds no row from them): the same tensors as mergekit."""
    config = _tokenizer_config(picollamas, ["base", "padded"], **extra, dtype="float32")
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name].shape == theirs[name].shape, name
        torch.testing.assert_close(ours[name], theirs[name], rtol=1e-6, atol=1e-7, msg=name)
    assert not torch.equal(ours["lm_head.weight"], _load_dir(Path(picollamas["base"]))["lm_head.weight"])


@pytest.mark.filterwarnings("ignore:.*does not use the parameter:UserWarning")
@pytest.mark.parametrize(
    ("names", "extra", "needle"),
    [
        (["base", "padded", "chatml"], {}, "rows differ only: set shape_mismatch: merge_common_rows"),
        (
            ["base", "padded", "chatml"],
            {"tokenizer": {"source": "union", "tokens": {"<|im_start|>": {"source": "base"}}}},
            "tokenizer.tokens['<|im_start|>']: the source 'base' is not the base or one of the models merged",
        ),
        (
            ["base", "chatml", "swapped"],
            {"tokenizer_source": "union"},
            "token '<|im_end|>' is id 65 in {chatml} and id 64 in {swapped} (the union numbers it once",
        ),
        (
            ["base", "chatml"],
            {"tokenizer": {"source": "union", "tokens": {"_tok_5": {"force": True}}}},
            "tokenizer.tokens['_tok_5']: mergekit builds this token's row from the rule's source, which must be",
        ),
        (
            ["base", "chatml"],
            {"tokenizer": {"source": "union", "tokens": {"<|new|>": {"source": {"kind": "zero"}}}}},
            "tokenizer.tokens['<|new|>']: no model has the token, so mergekit would add it",
        ),
    ],
)
def test_mergekit_tokenizer_configs_beyond_one_vocabulary_are_refused_in_one_line(
    names, extra, needle, picollamas, tmp_path
):
    """A model with more embedding rows than the base, and a union vocabulary: one-line refusals, nothing written."""
    with pytest.raises(ram_trl.RamTrlError) as info:
        ram_trl.merge(_tokenizer_config(picollamas, names, **extra), tmp_path / "out", progress=False)
    assert needle.format(**picollamas) in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------------------------
# mergekit's examples/ (not shipped in its wheel: the model-merge examples, as published), each model name mapped
# to a tiny stand-in, dtype float32 (the documented difference: ram_trl computes in float32 whatever `dtype` says)

MERGEKIT_EXAMPLES = {
    "gradient-slerp.yml": """
slices:
  - sources:
      - model: psmathur/orca_mini_v3_13b
        layer_range: [0, 40]
      - model: garage-bAInd/Platypus2-13B
        layer_range: [0, 40]
merge_method: slerp
base_model: psmathur/orca_mini_v3_13b
parameters:
  t:
    - filter: self_attn
      value: [0, 0.5, 0.3, 0.7, 1]
    - filter: mlp
      value: [1, 0.5, 0.7, 0.3, 0]
    - value: 0.5 # fallback for rest of tensors
dtype: float16
""",
    "ties.yml": """
models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      density: [1, 0.7, 0.1] # density gradient
      weight: 1.0
  - model: garage-bAInd/Platypus2-13B
    parameters:
      density: 0.5
      weight: [0, 0.3, 0.7, 1] # weight gradient
  - model: WizardLM/WizardMath-13B-V1.0
    parameters:
      density: 0.33
      weight:
        - filter: mlp
          value: 0.5
        - value: 0
merge_method: ties
base_model: TheBloke/Llama-2-13B-fp16
parameters:
  normalize: true
  int8_mask: true
dtype: float16
""",
    "linear.yml": """
models:
  - model: psmathur/orca_mini_v3_13b
    parameters:
      weight: 1.0
  - model: WizardLM/WizardLM-13B-V1.2
    parameters:
      weight: 0.3
  - model: garage-bAInd/Platypus2-13B
    parameters:
      weight: 0.5
merge_method: linear
dtype: float16
""",
    "bio-merge.yml": """
models:
  - model: mistralai/Mistral-7B-Instruct-v0.2
    parameters:
      density: 0.5
      weight: 0.5
  - model: BioMistral/BioMistral-7B
    parameters:
      density: 0.5
      weight: 0.5
merge_method: ties
base_model: mistralai/Mistral-7B-v0.1
parameters:
  normalize: false
  int8_mask: true
dtype: float16
""",
}

#: Each published model name's tiny stand-in: the base, or agent i of the `layered` fixture.
STAND_INS = {
    "TheBloke/Llama-2-13B-fp16": "base",
    "mistralai/Mistral-7B-v0.1": "base",
    "psmathur/orca_mini_v3_13b": 0,
    "garage-bAInd/Platypus2-13B": 1,
    "WizardLM/WizardMath-13B-V1.0": 2,
    "WizardLM/WizardLM-13B-V1.2": 2,
    "mistralai/Mistral-7B-Instruct-v0.2": 0,
    "BioMistral/BioMistral-7B": 1,
}


def _stand_in(text: str, ckpts: dict[str, Any]) -> dict[str, Any]:
    import yaml

    for name, which in STAND_INS.items():
        path = ckpts["base_dir"] if which == "base" else ckpts["agents"][which]
        text = text.replace(name, str(path))
    config = yaml.safe_load(text.replace("layer_range: [0, 40]", "layer_range: [0, 5]"))
    return {**config, "dtype": "float32"}


@pytest.mark.parametrize("example", list(MERGEKIT_EXAMPLES))
def test_mergekit_examples_equal_mergekit(example, layered, tmp_path):
    config = _stand_in(MERGEKIT_EXAMPLES[example], layered)
    if config["merge_method"] == "ties":
        _check_density_premise(config, layered["base"])
    ours, theirs = _run_both(config, tmp_path)
    assert set(ours) == set(theirs) == set(layered["base"])
    if config["merge_method"] != "linear":
        _assert_identical(ours, theirs)
        return
    # linear (a weighted average, no base): the same float32 sums in another order, an ulp apart at most
    for name in theirs:
        torch.testing.assert_close(ours[name], theirs[name], rtol=2.5e-7, atol=1e-8, msg=name)
        assert not torch.equal(ours[name], layered["base"][name]), name


def test_mergekit_layer_stacking_example_equals_mergekit(tmp_path):
    """examples/orcamini-platy-44layer.yml: passthrough layer stacking (24 + 20 of 40 layers; here 3 + 3 of 5) of two
    Llamas, as published (no base_model: both tools take config and tokenizer from a stacked model)."""
    import yaml

    text = """
slices:
  - sources:
    - model: psmathur/orca_mini_v3_13b
      layer_range: [0, 24]
  - sources:
    - model: garage-bAInd/Platypus2-13B
      layer_range: [20, 40]
merge_method: passthrough
dtype: float16
"""
    config = transformers.LlamaConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    for seed, name in enumerate(("psmathur/orca_mini_v3_13b", "garage-bAInd/Platypus2-13B")):
        torch.manual_seed(seed)
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        text = text.replace(name, str(tmp_path / name))
    config = yaml.safe_load(text.replace("[0, 24]", "[0, 3]").replace("[20, 40]", "[2, 5]"))
    ours, theirs = _run_both(config, tmp_path)
    assert sorted(ours) == sorted(theirs) and len({n.split(".")[2] for n in ours if ".layers." in n}) == 6
    for name, value in theirs.items():
        assert value.dtype == ours[name].dtype == torch.float16 and torch.equal(ours[name], value), name
    mine, mergekits = (json.loads((tmp_path / d / "config.json").read_text()) for d in ("ram_trl", "mergekit"))
    assert mine == mergekits and mine["num_hidden_layers"] == 6
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ram_trl", dtype=torch.float32)
    assert torch.isfinite(model(torch.tensor([[3, 1, 4, 1, 5]])).logits).all()
