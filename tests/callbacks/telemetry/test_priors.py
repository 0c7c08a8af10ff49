"""ram_trl/callbacks/telemetry/priors.py: prior stages read from their manifests, and their packed activity masks computed
with the merge's reader from real safetensors files (full and LoRA priors)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ram_trl.callbacks.telemetry.priors import PriorMasks, compute_prior_masks, read_prior_stages
from ram_trl.errors import ConfigError
from tests.callbacks.telemetry.helpers import L, write_base, write_full_prior, write_lora_prior, write_stage

EMBED = "model.embed_tokens.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
UP = "model.layers.1.mlp.up_proj.weight"


def test_prior_mask_bits_round_trip():
    mask = torch.rand(2, 37) > 0.5
    masks = PriorMasks([], {("w", 0): np.packbits(mask.numpy(), axis=1)})
    assert torch.equal(masks.rows("w", 0, 8, 29), mask[:, 8:])
    assert torch.equal(masks.rows("w", 0, 0, 37), mask)
    assert (masks.num_priors, masks.nbytes) == (0, 2 * 5)


def _priors(tmp_path):
    base = write_base(tmp_path / "base")
    full = write_stage(tmp_path, "full", write_full_prior(tmp_path / "full"), base)
    lora = write_stage(tmp_path, "lora", write_lora_prior(tmp_path / "lora"), base)
    return base, full, lora


def test_read_prior_stages(tmp_path):
    _, full, lora = _priors(tmp_path)
    stages = read_prior_stages([full, lora])
    assert [s.name for s in stages] == ["full", "lora"]
    assert stages[0].checkpoint == tmp_path / "full"
    with pytest.raises(ConfigError, match="the stage name 'full' appears more than once"):
        read_prior_stages([full, full])


def test_masks_by_hand(tmp_path):
    base, full, lora = _priors(tmp_path)
    stages = read_prior_stages([full, lora])
    # q_proj as two ranges of 2 elements (two processes' shares), embed_tokens whole; up_proj not measured here
    ranges = {Q: [(0, 2), (2, 2)], EMBED: [(0, 6)]}
    masks = compute_prior_masks(stages, base, ranges, eps=L / 2)
    assert sorted(masks.packed) == [(EMBED, 0), (Q, 0), (Q, 2)]
    # full prior: +L on element 0 of embed_tokens and q_proj; LoRA prior: B @ A = [[L, L], [0, 0]] on q_proj
    assert masks.rows(Q, 0, 0, 2).tolist() == [[True, False], [True, True]]
    assert masks.rows(Q, 2, 0, 2).tolist() == [[False, False], [False, False]]
    assert masks.rows(EMBED, 0, 0, 6).tolist() == [[True] + [False] * 5, [False] * 6]
    # the threshold is strict: at eps = L nothing is active
    strict = compute_prior_masks(stages, base, {Q: [(0, 4)]}, eps=L)
    assert not strict.rows(Q, 0, 0, 4).any()


def test_a_tensor_the_base_lacks_is_refused(tmp_path):
    base, full, _ = _priors(tmp_path)
    with pytest.raises(ConfigError, match="has no floating tensor 'model.extra.weight'"):
        compute_prior_masks(read_prior_stages([full]), base, {"model.extra.weight": [(0, 1)]}, eps=0.0)
