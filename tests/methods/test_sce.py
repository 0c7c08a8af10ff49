"""SCE: hand-computed selection, weights and erase on tiny vectors, and the engine streaming it in row chunks."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import ram_trl
from ram_trl.merging.planner import PROCESS_BASELINE_BYTES, bytes_per_element
from ram_trl.methods.base import ChunkInputs
from ram_trl.methods.sce import SCE, SceTensor, merge, prepare, sce_weights, select_mask
from tests.helpers import config_for, load_checkpoint, make_checkpoints


def test_selection_keeps_the_largest_variances_lowest_index_first_on_ties():
    taus = torch.tensor([[0.0, 1.0, 2.0, 0.0, 3.0, 3.0], [0.0, -1.0, 0.0, 0.0, 0.0, 0.0]])
    # variances across the two agents: 0, 1, 1, 0, 2.25, 2.25; four are nonzero
    assert select_mask(taus, 0.5).tolist() == [False, False, False, False, True, True]  # int(4 * 0.5) = 2
    # int(4 * 0.75) = 3: both 2.25, then the first of the two 1s
    assert select_mask(taus, 0.75).tolist() == [False, True, False, False, True, True]
    assert not select_mask(taus, 0.2).any()  # int(4 * 0.2) = 0
    assert not select_mask(taus, 0.0).any()


def test_weights_are_normalised_mean_squares():
    taus = torch.tensor([[1.0, 1.0], [2.0, 0.0]])  # mean squares 1 and 2
    assert sce_weights(taus).reshape(-1).tolist() == pytest.approx([1 / 3, 2 / 3])
    assert sce_weights(torch.zeros(4, 3)).reshape(-1).tolist() == [0.25] * 4  # below 1e-6: uniform


def test_erase_keeps_the_agents_of_the_elected_sign():
    taus = torch.tensor([[1.0, -2.0, 0.5, 0.0], [3.0, 1.0, -0.5, 0.0]])
    prepared = SceTensor(None, torch.tensor([[0.25], [0.75]]))
    out = merge(ChunkInputs("w", 0, taus.clone(), torch.zeros(4), {}, {}, prepared=prepared))
    # elem 0: both +, (0.25 + 2.25) / 1; elem 1: sum -1 elects -, only agent 0: -2;
    # elem 2: sum 0 elects +, only agent 0: 0.5; elem 3: nobody, 0 / 1e-6 = 0
    assert out.tolist() == [2.5, -2.0, 0.5, 0.0]


@pytest.mark.parametrize("select_topk", [1.0, 0.4])
def test_engine_streams_sce_in_row_chunks(tmp_path, select_topk):
    ckpts = make_checkpoints(tmp_path / "in", num_agents=3, fraction=0.5)
    config = config_for(ckpts, "sce", parameters={"select_topk": select_topk})
    ram_trl.merge(config, tmp_path / "whole", progress=False)
    ram_trl.merge(config, tmp_path / "chunked", progress=False, chunk_budget=1024)
    whole, chunked = load_checkpoint(tmp_path / "whole"), load_checkpoint(tmp_path / "chunked")
    moved = 0
    for name, base in ckpts.base_tensors.items():
        assert torch.equal(whole[name], chunked[name]), name
        moved += int((whole[name] != base).sum())
    assert moved > 0


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by live tensors that torch operations create (storages counted once, released
    when their last tensor dies)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.held: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self.held.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, tuple | list) else (out,):
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                key, nbytes = storage.data_ptr(), storage.nbytes()
                if nbytes and key not in self.held:
                    self.held.add(key)
                    self.live += nbytes
                    weakref.finalize(storage, self._release, key, nbytes)
                    self.peak = max(self.peak, self.live)
        return out


class StoredView:
    """A :class:`~ram_trl.methods.base.TensorView` over stored bf16 tensors (base first): float32 copies on
    request, as the engine's view returns them."""

    def __init__(self, stored: list[torch.Tensor], params: dict) -> None:
        self.stored, self.params, self.num_agents = stored, params, len(stored) - 1

    def base(self) -> torch.Tensor:
        return self.stored[0].float()

    def model(self, t: int) -> torch.Tensor:
        return self.stored[t + 1].float()


@pytest.mark.parametrize("select_topk", [1.0, 0.999, 0.5])
def test_preparation_memory_grows_with_the_agents_and_stays_under_the_planner_estimate(select_topk):
    n = 1 << 18
    generator = torch.Generator().manual_seed(0)
    measured = {}
    for k in (1, 2, 5, 8):
        stored = [torch.randn(n, generator=generator).to(torch.bfloat16) for _ in range(k + 1)]
        with LiveBytes() as probe:
            prepare(StoredView(stored, {"select_topk": select_topk}))
        measured[k] = probe.peak / n
        assert measured[k] <= SCE.preparation_bytes(k), (k, measured[k])
    # the stacked task vectors and their squares: 8 bytes per element for each agent (a fixed figure cannot hold)
    assert measured[8] - measured[5] >= 3 * 8
    assert SCE.preparation_bytes(8) - SCE.preparation_bytes(5) == 3 * 8


def test_dry_run_estimate_counts_every_agents_task_vector(tmp_path):
    peaks = {}
    for k in (2, 6):
        ckpts = make_checkpoints(tmp_path / str(k), num_agents=k)
        plan = ram_trl.merge(config_for(ckpts, "sce"), tmp_path / "out", dry_run=True, progress=False)
        largest = max(ckpts.base_tensors.values(), key=torch.Tensor.numel)
        itemsize = largest.element_size()  # every tensor fits one chunk: the largest holds the most buffers
        chunk = largest.numel() * bytes_per_element(k, itemsize, itemsize)
        peaks[k] = plan["peak_memory_estimate"]
        assert peaks[k] == PROCESS_BASELINE_BYTES + chunk + (max(8 * k + 5, 4 * k + 25) + 4) * largest.numel()
    assert peaks[6] > peaks[2]
