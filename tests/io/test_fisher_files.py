"""Fisher files as merge inputs (:mod:`ram_trl.io.fisher_files`): where they are, header checks against the base and
the agent, row reads and the finite, non-negative check, on real safetensors files."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.errors import CheckpointError, NonFiniteError
from ram_trl.io.checkpoint import FISHER_FILE, open_checkpoint
from ram_trl.io.fisher_files import (
    check_fisher_headers,
    default_fisher_path,
    fill_fisher,
    fisher_itemsize,
    fisher_nbytes,
    open_fisher,
    read_fisher_rows,
)
from ram_trl.io.safetensors_io import RowReader
from tests.helpers import EMBED, UP, VOCAB, base_tensors, save_checkpoint


def write_fisher(path, tensors: dict[str, torch.Tensor]):
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / FISHER_FILE))
    return path / FISHER_FILE


@pytest.fixture
def inputs(tmp_path):
    tensors = base_tensors()
    base = open_checkpoint(save_checkpoint(tmp_path / "base", tensors), "base model")
    agent_dir = save_checkpoint(tmp_path / "agent", tensors)
    return tmp_path, tensors, base, open_checkpoint(agent_dir, "agent 0"), agent_dir


def test_default_path_is_beside_the_agent(tmp_path):
    (tmp_path / "agent").mkdir()
    assert default_fisher_path(tmp_path / "agent") == tmp_path / "agent" / FISHER_FILE
    single = tmp_path / "agent" / "model.safetensors"
    single.write_bytes(b"")
    assert default_fisher_path(single) == tmp_path / "agent" / FISHER_FILE


def test_missing_file_names_the_agent_and_how_to_make_it(tmp_path):
    with pytest.raises(CheckpointError, match=r"agent 0 \(coder\): Fisher file .* does not exist; estimate it with "):
        open_fisher(tmp_path / "coder", "agent 0 (coder)", tmp_path / "coder")


def test_headers_accept_the_base_shapes_and_refuse_missing_integer_or_misshapen_tensors(inputs):
    root, tensors, base, agent, agent_dir = inputs
    names = sorted(tensors)
    write_fisher(agent_dir, {n: torch.rand(t.shape) for n, t in tensors.items()})
    fisher = open_fisher(agent_dir, "agent 0", agent_dir)  # a directory: its fisher.safetensors
    check_fisher_headers(fisher, agent, base, names)
    assert fisher_itemsize(fisher) == 4
    assert fisher_nbytes(fisher, [UP, EMBED]) == 4 * (tensors[UP].numel() + tensors[EMBED].numel())

    cases = {
        "missing": ({n: torch.rand(t.shape) for n, t in tensors.items() if n != UP}, "no Fisher for tensor"),
        "integer": ({**{n: torch.rand(t.shape) for n, t in tensors.items()}, UP: torch.ones(tensors[UP].shape, dtype=torch.int32)}, "a Fisher is floating"),
        "shape": ({**{n: torch.rand(t.shape) for n, t in tensors.items()}, UP: torch.rand(3, 3)}, r"has shape \[3, 3\]"),
    }  # fmt: skip
    for case, (values, message) in cases.items():
        path = write_fisher(root / case, values)
        with pytest.raises(CheckpointError, match=message):
            check_fisher_headers(open_fisher(path, f"agent {case}", agent_dir), agent, base, names)


def test_a_resized_agent_may_have_its_own_rows(tmp_path):
    tensors = base_tensors()
    base = open_checkpoint(save_checkpoint(tmp_path / "base", tensors), "base model")
    bigger = base_tensors(vocab=VOCAB + 4)
    agent = open_checkpoint(save_checkpoint(tmp_path / "agent", bigger, VOCAB + 4), "agent 0")
    path = write_fisher(tmp_path / "fisher", {n: torch.rand(t.shape) for n, t in bigger.items()})
    check_fisher_headers(open_fisher(path, "agent 0", tmp_path / "agent"), agent, base, sorted(tensors))


def test_rows_are_read_as_stored_and_missing_rows_are_zero(tmp_path):
    values = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    fisher = open_fisher(write_fisher(tmp_path, {"w": values}), "agent 0", tmp_path)
    reader = RowReader()
    try:
        raw = read_fisher_rows(fisher, "w", reader, 2, 6)  # the file has 4 rows: 2 and 3 come back
        assert torch.equal(raw, values[2:4])
        assert read_fisher_rows(fisher, "w", reader, 4, 6) is None
        out = torch.full((12,), -1.0)
        fill_fisher(out, raw, fisher, "w", 2)
        assert out.tolist() == values[2:4].reshape(-1).tolist() + [0.0] * 6
        fill_fisher(out[:3], None, fisher, "w", 4)
        assert out[:3].tolist() == [0.0, 0.0, 0.0]
    finally:
        reader.close()


@pytest.mark.parametrize("bad, what", [(float("nan"), "1 NaN/Inf"), (float("inf"), "1 NaN/Inf"), (-1.0, "1 negative")])
def test_nonfinite_or_negative_values_name_the_file_and_tensor(tmp_path, bad, what):
    values = torch.ones(2, 3)
    values[1, 2] = bad
    fisher = open_fisher(write_fisher(tmp_path, {"w": values}), "agent 1", tmp_path)
    with pytest.raises(
        NonFiniteError, match=rf"agent 1: Fisher file .*: tensor 'w' holds {what} values \(rows from 0\)"
    ):
        fill_fisher(torch.empty(6), values, fisher, "w", 0)
