"""``merge(..., device="cuda")`` on the fake CUDA device: every registered method, with 3 and with 13 agents (the
overlap statistics' subset-code path and its >12-agent path), writes the same bytes as the CPU merge."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import save_file

import ram_trl
from ram_trl.errors import ConfigError
from ram_trl.io.checkpoint import FISHER_FILE
from ram_trl.methods.registry import method_names
from tests.fake_cuda import FakeCudaTensor, fake_cuda_device
from tests.helpers import config_for, make_checkpoints, random_fisher


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.mark.parametrize("agents", [3, 13])
@pytest.mark.parametrize("method", method_names())
def test_cuda_merge_is_byte_identical_to_the_cpu_merge(tmp_path, monkeypatch, agents, method):
    ckpts = make_checkpoints(tmp_path / "inputs", num_agents=agents)
    if method == "fisher":
        for i, agent in enumerate(ckpts.agents):
            save_file(random_fisher(ckpts.base_tensors, seed=100 + i), str(agent / FISHER_FILE))
    config = config_for(ckpts, method)
    try:
        ram_trl.merge(config, tmp_path / "cpu", progress=False)
    except ConfigError as error:  # e.g. slerp takes two agents, fisher needs Fisher files
        pytest.skip(f"{method} with {agents} agents: {error}")
    created = FakeCudaTensor.created
    with fake_cuda_device(monkeypatch):
        ram_trl.merge(config, tmp_path / "cuda", progress=False, device="cuda")
    assert FakeCudaTensor.created > created  # the arithmetic ran on the device
    cpu, cuda = _files(tmp_path / "cpu"), _files(tmp_path / "cuda")
    assert any(name.endswith(".safetensors") for name in cpu)
    for name, data in cpu.items():
        if name.endswith(".safetensors"):
            assert cuda[name] == data, f"{method}: {name} differs"
