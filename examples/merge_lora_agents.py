"""Merge LoRA agents (PEFT adapters) with RAM+ and load the result (CPU, seconds).

    python examples/merge_lora_agents.py /tmp/lora_merge

Two LoRA adapters on a tiny base stand in for GRPO LoRA runs (their B matrices are set to random values so the
adapters change the model). The merge streams each adapter's dense delta ``B @ A * scaling``; the output is a full
model directory (``--output-format lora`` on the command line would export a LoRA adapter instead).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

import ram_trl
from ram_trl.synthetic import make_base_checkpoint


def make_adapter(base: Path, out: Path, targets: list[str], seed: int) -> Path:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.01)
    peft_model.save_pretrained(out)
    return out


def main(root: str) -> None:
    root_path = Path(root)
    base = make_base_checkpoint(root_path / "base", hidden_size=32, num_layers=2, intermediate_size=64)
    coding = make_adapter(base, root_path / "coding-lora", ["q_proj", "v_proj"], seed=1)
    tools = make_adapter(base, root_path / "tools-lora", ["v_proj", "down_proj"], seed=2)
    config = {
        "merge_method": "ram_plus",
        "base_model": str(base),
        "models": [{"model": str(coding)}, {"model": str(tools)}],
        "parameters": {"r": 0.1, "alpha": 2.0},
    }
    report = ram_trl.merge(config, root_path / "merged", overwrite=True, progress=False)
    for agent in report["agents"]:
        print(agent["name"], {k: agent.get(k) for k in ("kind", "density", "rho", "lambda")})
    merged = AutoModelForCausalLM.from_pretrained(root_path / "merged")
    print("merged model loads:", type(merged).__name__, sum(p.numel() for p in merged.parameters()), "parameters")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "lora_merge_out")
