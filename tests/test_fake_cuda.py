"""The fake CUDA device of ``tests/fake_cuda.py``: it refuses the mixes CUDA refuses and allows the ones CUDA allows."""

from __future__ import annotations

import pytest
import torch

from tests.fake_cuda import FakeCudaTensor, fake_cuda_device

MISMATCH = "Expected all tensors to be on the same device"


def test_reports_cuda_and_keeps_cpu_numbers(fake_cuda: torch.device) -> None:
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    assert isinstance(x, FakeCudaTensor) and x.device == fake_cuda and x.is_cuda
    assert torch.cuda.is_available() and torch.cuda.device_count() == 1
    y = (x * 2 + torch.tensor(1.0)).reshape(2, 3)
    assert y.device == fake_cuda
    assert y.tolist() == [[1.0, 3.0, 5.0], [7.0, 9.0, 11.0]]
    assert y.sum().item() == 36.0 and float(y.sum()) == 36.0 and int(y[1, 2]) == 11
    assert y.cpu().device.type == "cpu" and torch.equal(y.cpu(), torch.tensor([[1.0, 3, 5], [7, 9, 11]]))


def test_host_accumulator_plus_device_sum_raises(fake_cuda: torch.device) -> None:
    """The reported crash: ``squares += part.square_sum`` (host float64 0-d += device 0-d)."""
    squares = torch.zeros((), dtype=torch.float64)
    part = torch.ones(4, device="cuda").to(torch.float64).square().sum()
    with pytest.raises(RuntimeError, match=MISMATCH):
        squares += part
    with pytest.raises(RuntimeError, match=MISMATCH):
        torch.add(part, 1.0, out=squares)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: torch.arange(x.numel(), dtype=x.dtype) * x,  # gini: host ranks times device values
        lambda x: torch.searchsorted(x, torch.tensor([2.0])),  # choose_rank: host target
        lambda x: torch.cat([x, torch.ones(2)]),
        lambda x: torch.zeros(3, dtype=torch.int64).add_(torch.ones(3, dtype=torch.int64, device="cuda")),
        lambda x: torch.zeros(2, 3, dtype=torch.int64)[0].__iadd__(torch.ones((), dtype=torch.int64, device="cuda")),
        lambda x: torch.nn.Linear(6, 2)(x),
    ],
)
def test_mixes_cuda_refuses_raise(fake_cuda: torch.device, op) -> None:
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match=MISMATCH):
        op(x)


def test_mixes_cuda_allows_work(fake_cuda: torch.device) -> None:
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    assert (x + torch.tensor(2.0)).device == fake_cuda  # a CPU 0-d input, device output
    assert (torch.tensor(2.0) * x.sum()).device == fake_cuda
    host = torch.empty(3)
    host.copy_(x[:3])  # device -> host copy
    assert host.tolist() == [0.0, 1.0, 2.0]
    x[:3].copy_(torch.tensor([7.0, 8.0, 9.0]))  # host -> device copy
    assert x.tolist() == [7.0, 8.0, 9.0, 3.0, 4.0, 5.0]
    assert x[torch.tensor([0, 5])].tolist() == [7.0, 5.0]  # CPU index tensors
    assert x[torch.tensor([True, False, False, False, False, True])].tolist() == [7.0, 5.0]
    x[torch.tensor([1])] = 0.0
    assert x.tolist()[1] == 0.0
    with pytest.raises(RuntimeError, match=MISMATCH):
        x[:2] = torch.ones(2)  # a CPU tensor of values with dimensions


def test_to_cuda_copies_and_views_alias(fake_cuda: torch.device) -> None:
    host = torch.zeros(4)
    moved = host.to("cuda")
    moved.add_(1.0)
    assert host.tolist() == [0.0] * 4 and moved.tolist() == [1.0] * 4
    assert moved.to("cuda") is moved and moved.cuda() is moved
    view = moved[1:3]
    view.mul_(5.0)
    assert moved.tolist() == [1.0, 5.0, 5.0, 1.0]
    assert torch.zeros_like(moved).device == fake_cuda and moved.new_zeros(2).device == fake_cuda
    assert torch.zeros(2, device=fake_cuda).device == fake_cuda
    module = torch.nn.Linear(3, 2).to("cuda")
    assert module.weight.device == fake_cuda and isinstance(module.weight, torch.nn.Parameter)
    assert module(torch.ones(1, 3, device="cuda")).device == fake_cuda


def test_storage_is_shared_as_on_cuda(fake_cuda: torch.device) -> None:
    """``untyped_storage().data_ptr()`` (how a state dict's tied weights are found) tells shared memory apart as CUDA
    does: a tensor, its detached alias and its views share one storage; a copy has its own."""
    x = torch.arange(6, dtype=torch.float32, device="cuda")
    copy = x.clone()
    assert x.untyped_storage().data_ptr() == x.detach().untyped_storage().data_ptr()
    assert x.untyped_storage().data_ptr() == x[2:].untyped_storage().data_ptr() and x[2:].storage_offset() == 2
    assert copy.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    tied = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    tied.to("cuda")
    assert tied[1].weight is tied[0].weight and tied[0].weight.device == fake_cuda  # as Module.to on CUDA


def test_rng_state_and_patches_are_restored() -> None:
    monkeypatch = pytest.MonkeyPatch()
    real = torch.cuda.is_available()
    with fake_cuda_device(monkeypatch):
        state = torch.cuda.get_rng_state()
        torch.manual_seed(5)  # seeds every CUDA device too, as torch does
        assert not torch.equal(torch.cuda.get_rng_state(), state)
    monkeypatch.undo()
    assert torch.cuda.is_available() == real
    assert torch.ones(2).device.type == "cpu"
