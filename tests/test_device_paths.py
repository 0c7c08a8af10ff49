"""Host/device correctness of the helpers the merge, the telemetry and the recipes share, on the CPU and on the fake
CUDA device (``tests/fake_cuda.py``): the same numbers on both, and no host/device mix CUDA would refuse."""

from __future__ import annotations

import pytest
import torch

from ram_trl.evaluation.scoring import generate
from ram_trl.merging.lora.svd import LoraExportOptions, choose_rank
from ram_trl.recipes.schema import EvaluationSpec
from ram_trl.statistics import OverlapStatistics
from ram_trl.statistics.magnitude import histogram_gini, histogram_top_mass
from tests.helpers import magnitude_of


def _values() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4096, generator=g) * 10.0 ** torch.randint(-6, -2, (4096,), generator=g)


def test_magnitude_helpers(device):
    values = _values()
    on_device = values.to(device)
    stats = magnitude_of(values)
    counts, sums = stats.counts[0], stats.sums[0]
    expected = (histogram_gini(counts, sums), histogram_top_mass(counts, sums, 0.05))
    counts, sums = counts.to(device), sums.to(device)
    assert (histogram_gini(counts, sums), histogram_top_mass(counts, sums, 0.05)) == expected
    moved = magnitude_of(on_device)
    assert moved.summary(0) == stats.summary(0)


@pytest.mark.parametrize("agents", [3, 13])
def test_overlap_statistics_update(device, agents):
    g = torch.Generator().manual_seed(agents)
    mask = torch.rand(agents, 2000, generator=g) < 0.3
    expected = OverlapStatistics.zeros(agents)
    expected.update(mask)
    expected.update(mask[:, :500])
    got = OverlapStatistics.zeros(agents)
    got.update(mask.to(device))
    got.update(mask[:, :500].to(device))
    assert got.histogram.device.type == "cpu"  # host totals
    assert torch.equal(got.histogram, expected.histogram) and torch.equal(got.pairwise, expected.pairwise)
    assert got.numel == expected.numel == 2500
    # the >12-agent path agrees with the subset-code path on the same agents
    if agents == 3:
        assert expected.histogram[:, 1:].sum() == mask.sum() + mask[:, :500].sum()


def test_overlap_many_agents_counts_by_hand(device):
    mask = torch.zeros(13, 4, dtype=torch.bool)
    mask[:, 0] = True  # all 13 agents
    mask[0, 1] = mask[1, 1] = True  # agents 0 and 1
    mask[5, 2] = True  # agent 5 alone
    stats = OverlapStatistics.zeros(13)
    stats.update(mask.to(device))
    assert stats.histogram[0].tolist() == [0, 0, 1] + [0] * 10 + [1]
    assert stats.histogram[5].tolist() == [0, 1] + [0] * 11 + [1]
    assert stats.pairwise[0, 1] == stats.pairwise[1, 0] == 2 and stats.pairwise[0, 5] == 1
    assert stats.pairwise.diagonal().tolist() == [2, 2] + [1] * 3 + [2] + [1] * 7


def test_choose_rank(device):
    singular = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.5])
    options = LoraExportOptions(max_rank=5, energy=0.9)
    assert choose_rank(singular.to(device), options) == choose_rank(singular, options) == 3  # 29 >= 0.9 * 30.25


class _StubTokenizer:
    pad_token_id = 0
    eos_token_id = 1

    def __call__(self, prompts, **kwargs):
        ids = torch.tensor([[2 + len(p)] * 3 for p in prompts])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def batch_decode(self, new, skip_special_tokens=True):
        return [" ".join(str(t) for t in row.tolist()) for row in new]


class _StubModel(torch.nn.Module):
    """``generate`` as transformers 4.x runs it: no input is moved to the model's device."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(2))

    def generate(self, input_ids, attention_mask, max_new_tokens, **kwargs):
        assert input_ids.device == self.weight.device == attention_mask.device
        return torch.cat([input_ids, input_ids[:, :1] + self.weight[:1].long()], dim=1)


def test_generate_moves_inputs_to_the_model(device):
    model = _StubModel().to(device)
    spec = EvaluationSpec(batch_size=2, max_new_tokens=1)
    assert generate(model, _StubTokenizer(), ["a", "bb", "ccc"], spec) == ["4", "5", "6"]


def test_fisher_sampling_restores_the_cuda_rng(fake_cuda):
    from ram_trl.evaluation.fisher import generate_completions

    class Tokenizer(_StubTokenizer):
        def __call__(self, prompt, return_tensors="pt"):
            return {"input_ids": torch.tensor([[2, 3]])}

    class Model(_StubModel):
        generation_config = None

        def generate(self, ids, attention_mask, generation_config):
            torch.cuda.manual_seed(123)  # as a sampling step would advance the device generator
            return torch.cat([ids, torch.ones(1, 1, dtype=ids.dtype, device=ids.device)], dim=1)

    before = torch.cuda.get_rng_state()
    completions = generate_completions(Model().to(fake_cuda), Tokenizer(), ["p"], max_new_tokens=1, seed=7)
    assert completions[0].completion_ids.tolist() == [1]
    assert torch.equal(torch.cuda.get_rng_state(), before)
