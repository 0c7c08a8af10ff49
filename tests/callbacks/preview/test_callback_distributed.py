"""MergePreviewCallback in a real TRL GRPO run under DDP on 2 CPU processes (torchrun, gloo).

tests/_grpo_preview_worker.py trains on 2 ranks; the main rank saves, merges and scores, the records are broadcast.
Both ranks must log the same previews and keep the same step, and the final ``ram-trl merge`` of the manifests must
be the preview at the kept step bit for bit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

import ram_trl
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback
from ram_trl.digest import weights_digest
from ram_trl.stage.manifest import read_manifest
from ram_trl.synthetic import make_base_checkpoint
from tests._launch import free_port, run_job
from tests.helpers import distinct_chars, rl_config, rl_prompts, train_rl

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).parents[2] / "_grpo_preview_worker.py"
WORLD = 2


def test_ddp_preview_agrees_on_every_rank_and_is_the_merge(tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    base = make_base_checkpoint(tmp_path / "base", hidden_size=32, num_layers=2, intermediate_size=64)
    first = tmp_path / "first"
    # logging_steps 500: TrainingArguments' default
    config = rl_config(GRPOConfig, first, max_steps=2, logging_steps=500, learning_rate=3e-3)
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="first")
    train_rl(GRPOTrainer, base, config, callback, distinct_chars, rl_prompts(8, ("ab", "cd")))

    second = tmp_path / "second"
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "ACCELERATE_USE_CPU": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(WORLD)]
    command += ["--master_port", str(port), str(WORKER), str(base), str(first), str(second)]
    result = run_job(command, port, cwd=WORKER.parent, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"DDP preview job failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
    ranks = [json.loads((second / f"preview_rank{r}.json").read_text()) for r in range(WORLD)]
    assert all(r["world_size"] == WORLD and r["distributed_type"].endswith("MULTI_CPU") for r in ranks)
    assert ranks[0]["history"] == ranks[1]["history"] and ranks[0]["kept_step"] == ranks[1]["kept_step"]
    assert [h["step"] for h in ranks[0]["history"]] == [2, 3]
    assert all(h["merge_processes"] == WORLD for h in ranks[0]["history"])  # each rank merged its share
    logged = ranks[0]["logged"]
    assert [e["merge_preview/average"] for e in logged] == [h["average"] for h in ranks[0]["history"]]
    record = read_manifest(second).extra["preview"]
    assert record["kept_step"] == ranks[0]["kept_step"]
    kept = next(h for h in ranks[0]["history"] if h["step"] == record["kept_step"])
    merged = tmp_path / "merged"
    models = [{"stage": str(first)}, {"stage": str(second)}]
    ram_trl.merge(
        {"merge_method": "ram_plus", "base_model": str(base), "models": models, "out_dtype": "float32"},
        merged,
        progress=False,
    )  # the preview writes (and scores) its merges in float32
    assert weights_digest(merged) == kept["merged_sha256"]
