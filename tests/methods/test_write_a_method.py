"""docs/write-a-method.md: its example method, taken from the page as written, registers and merges."""

from __future__ import annotations

import re
from pathlib import Path

import torch

import ram_trl
from ram_trl.methods import method_names, registry
from tests.helpers import config_for, load_checkpoint, make_checkpoints

PAGE = Path(__file__).parents[2] / "docs" / "write-a-method.md"


def test_the_pages_example_merges(tmp_path, monkeypatch):
    monkeypatch.setattr(registry, "_METHODS", dict(registry._METHODS))
    code = re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)[0]
    namespace: dict = {"__name__": "sign_mean"}
    exec(compile(code, str(PAGE), "exec"), namespace)  # noqa: S102 - our own docs page
    registry.register(namespace["SIGN_MEAN"])
    assert "sign_mean" in method_names()

    ckpts = make_checkpoints(tmp_path / "in", 2, fraction=0.5)
    config = config_for(ckpts, "sign_mean", parameters={"lambda": 2.0})
    ram_trl.merge(config, tmp_path / "out", progress=False, chunk_budget=2048)
    merged = load_checkpoint(tmp_path / "out")
    for name, base in ckpts.base_tensors.items():
        taus = torch.stack([agent[name] - base for agent in ckpts.agent_tensors])
        agree = (torch.sign(taus) == torch.sign(taus[0])).all(dim=0)
        torch.testing.assert_close(merged[name], base + taus.mean(dim=0) * agree * 2.0, rtol=0, atol=1e-6)
