"""Memory bounds: the planner's chunking keeps every buffer the merge creates under the chunk budget.

A TorchDispatchMode sees every tensor that every torch operation creates during a merge (reads included: the
reader allocates its buffers with torch); the largest must fit the budget, whatever the size of the model's
tensors. (A behaviour test on allocation sizes, not a timing.)
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode

import ram_trl
import ram_trl.merging.streaming
import ram_trl.parallel
from ram_trl.io.checkpoint import FISHER_FILE
from ram_trl.io.prefetch import read_ahead
from ram_trl.merging.planner import bytes_per_element, chunk_elements
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from tests.helpers import random_fisher

BUDGET = 256 * 1024


class LargestBuffer(TorchDispatchMode):
    """Records the largest tensor any operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor) and value.untyped_storage().nbytes() > self.largest:
                self.largest = value.untyped_storage().nbytes()
                self.op = str(func)
        return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    root = tmp_path_factory.mktemp("mem")
    # a 2048-row vocabulary: embed_tokens and lm_head hold 128K elements each, 512 KB in float32
    base = make_base_checkpoint(root / "base", hidden_size=64, num_layers=2, intermediate_size=128, vocab_size=2048)
    return base, make_agent_set(base, root, densities=(0.03, 0.46, 0.54), seed=2)


@pytest.mark.parametrize("method", ["ram_plus", "task_arithmetic", "dare_ties", "fisher"])
def test_largest_buffer_stays_under_the_chunk_budget(model, tmp_path, monkeypatch, method):
    base, agents = model
    if method == "fisher":
        base_state = load_file(str(base / "model.safetensors"))
        for i, agent in enumerate(agents):
            save_file(random_fisher(base_state, seed=i), str(agent / FISHER_FILE))
    # read in this thread so that the dispatch mode (thread-local) sees the reader's buffers too
    monkeypatch.setattr(
        ram_trl.merging.streaming, "read_ahead", lambda items, read, depth=1, readers=1: read_ahead(items, read, 0)
    )
    config = {
        "merge_method": method,
        "base_model": str(base),
        "models": [{"model": str(a), "parameters": {"density": 0.5} if "dare" in method else {}} for a in agents],
    }
    # and compute on this thread too (a thread plan for one core: no block pool), for the same reason
    monkeypatch.setattr(ram_trl.parallel, "available_cores", lambda: 1)
    assert ram_trl.parallel.plan_threads().compute == 1
    with LargestBuffer() as probe:
        report = ram_trl.merge(config, tmp_path / "out", chunk_budget=BUDGET, progress=False)
    # the embedding alone is 512 KB as float32 (1.5 MB of task vectors for 3 agents): far over the budget
    assert report["total_elements"] > 2 * 2048 * 64
    assert 3 * 2048 * 64 * 4 >= 4 * BUDGET  # noqa: SIM300 - the task vectors of one tensor exceed the budget
    assert probe.largest <= BUDGET, f"{probe.op} created a {probe.largest}-byte buffer"
    # and the budget is used: chunks are not needlessly tiny
    # (Fisher inputs add 12 bytes per agent and element to the budget: its chunks are a little smaller)
    assert probe.largest >= BUDGET // (10 if method == "fisher" else 8)


def test_budget_formula_counts_every_agent():
    assert bytes_per_element(3, 2, 2) == 10 * 3 + 20 + 2 * 4 * 2 + 3 * 2
    assert chunk_elements(BUDGET, 3, 2, 2) * bytes_per_element(3, 2, 2) <= BUDGET
    assert chunk_elements(BUDGET, 8) < chunk_elements(BUDGET, 2)
