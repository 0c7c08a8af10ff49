"""MergePreviewCallback in a real TRL GRPO run under DeepSpeed ZeRO-3 on 2 CPU processes (gloo).

tests/_grpo_preview_zero3_worker.py trains on 2 ranks whose parameters are all ZeRO-3 partitions; at each preview
every rank merges its own partitions with the prior stage (every parameter-gathering collective patched to raise),
the merged values replace the partitions for scoring through ZeRO-3's own gathering, and the policy's are restored.
The merged elements of both ranks, put together, must be ``ram-trl merge`` of the saved checkpoints bit for bit, the
scores those of ``ram-trl eval`` of that merge, and training must go on from the restored partitions.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install -e '.[distributed]')")

import ram_trl  # noqa: E402
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback  # noqa: E402
from ram_trl.evaluation.scoring import evaluate_model  # noqa: E402
from ram_trl.evaluation.spec import EvaluationSpec  # noqa: E402
from ram_trl.stage.manifest import read_manifest  # noqa: E402
from ram_trl.synthetic import make_base_checkpoint  # noqa: E402
from tests._launch import free_port, run_job  # noqa: E402
from tests.helpers import distinct_chars, load_checkpoint, preview_tasks, rl_config, rl_prompts, train_rl  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

WORKER = Path(__file__).parents[2] / "_grpo_preview_zero3_worker.py"
WORLD = 2
EVALUATION = {"max_new_tokens": 8, "batch_size": 8}  # the worker's
PARAMETERS = 27  # of the tiny Qwen2 model


def launch(base: Path, first: Path, out: Path, *extra: str) -> None:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(WORLD)]
    command += ["--master_port", str(port), str(WORKER), str(base), str(first), str(out), *extra]
    result = run_job(command, port, cwd=WORKER.parent, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, f"ZeRO-3 preview job failed:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    root = tmp_path_factory.mktemp("preview_zero3")
    base = make_base_checkpoint(root / "base", hidden_size=32, num_layers=2, intermediate_size=64)
    first = root / "first"
    config = rl_config(GRPOConfig, first, max_steps=2, logging_steps=500, learning_rate=3e-3)
    train_rl(
        GRPOTrainer,
        base,
        config,
        TaskVectorSparsityCallback(base_model=base, stage_name="first"),
        distinct_chars,
        rl_prompts(8, ("ab", "cd")),
    )
    second = root / "second"
    launch(base, first, second)
    ranks = [json.loads((second / f"preview_rank{r}.json").read_text()) for r in range(WORLD)]
    return {"root": root, "base": base, "first": first, "second": second, "ranks": ranks}


def merged_partitions(second: Path, step: int) -> dict[str, torch.Tensor]:
    """The merged elements both ranks computed at ``step``, put together into flat tensors."""
    parts: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for rank in range(WORLD):
        for key, values in load_checkpoint_file(second / "ranges" / f"rank{rank}-step{step}.safetensors").items():
            name, offset = key.rsplit("|", 1)
            parts.setdefault(name, []).append((int(offset), values))
    out = {}
    for name, pieces in parts.items():
        pieces.sort(key=lambda p: p[0])
        flat = torch.cat([v for _, v in pieces])
        assert [o for o, _ in pieces] == [sum(v.numel() for _, v in pieces[:i]) for i in range(len(pieces))]
        out[name] = flat
    return out


def load_checkpoint_file(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_every_rank_merged_its_partitions_without_gathering(run) -> None:
    first, second = run["ranks"]
    for rank in run["ranks"]:
        assert rank["world_size"] == WORLD and rank["partitioned"] is True
        calls = rank["calls"]
        assert calls["merges"] == 2  # steps 2 and 3
        assert calls["partitioned"] == 2 * PARAMETERS
        assert calls["all_reduce"] == 2  # one all-reduce of the integer counts per merge
    assert first["history"] == second["history"] and first["kept_step"] == second["kept_step"]
    assert [h["step"] for h in first["history"]] == [2, 3]
    assert all(h["merge_processes"] == WORLD and h["merge_kind"] == "partitions" for h in first["history"])
    assert [e["merge_preview/average"] for e in first["logged"]] == [h["average"] for h in first["history"]]


def test_merged_partitions_are_the_merge_of_the_saved_checkpoints_bit_for_bit(run) -> None:
    history = run["ranks"][0]["history"]
    record = read_manifest(run["second"]).extra["preview"]
    assert record["kept_step"] == run["ranks"][0]["kept_step"]
    checkpoints = {record["kept_step"]: run["second"]}
    checkpoints[record["last_step"]] = run["second"] / record["last_checkpoint"]
    assert set(checkpoints) <= {h["step"] for h in history}
    spec = EvaluationSpec.model_validate(EVALUATION)
    for step, agent in checkpoints.items():
        merged = run["root"] / f"merged-{step}"
        models = [{"stage": str(run["first"])}, {"model": str(agent), "name": "second"}]
        ram_trl.merge(
            {"merge_method": "ram_plus", "base_model": str(run["base"]), "models": models, "out_dtype": "float32"},
            merged,
            progress=False,
        )
        expected = load_checkpoint(merged)
        got = merged_partitions(run["second"], step)
        assert set(got) == set(expected)
        for name, value in expected.items():
            assert torch.equal(got[name].view(torch.int32), value.reshape(-1).view(torch.int32)), (step, name)
        # the scores are `ram-trl eval` of that merge (float32 training and evaluation), the agent's of its checkpoint
        entry = next(h for h in history if h["step"] == step)
        scored = evaluate_model(merged, preview_tasks(), spec, progress=False)
        assert entry["scores"] == {t.stage: scored["scores"][t.stage] for t in preview_tasks()}
        own = evaluate_model(agent, [preview_tasks()[1]], spec, progress=False)
        assert entry["agent_score"] == own["scores"]["second"]


def test_the_policy_partitions_are_restored_after_each_preview(run) -> None:
    """Every preview swaps the merged weights (and the policy rounded to its save dtype) into the partitions to
    score them; after it, every rank's partitions are the policy's again, bit for bit, and the run trains on."""
    from transformers import AutoModelForCausalLM

    for rank in run["ranks"]:
        assert rank["restored"] == [True, True]
    record = read_manifest(run["second"]).extra["preview"]
    model = AutoModelForCausalLM.from_pretrained(run["second"] / record["last_checkpoint"])
    assert model.config.model_type == "qwen2"


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("ties", "merge method 'ties' needs whole tensors"),
        ("no-16bit-save", "needs stage3_gather_16bit_weights_on_model_save: true"),
    ],
)
def test_what_a_partitioned_preview_cannot_do_is_refused_at_train_begin(run, tmp_path, mode, message) -> None:
    out = tmp_path / mode
    launch(run["base"], run["first"], out, mode)
    for rank in range(WORLD):
        assert message in (out / f"refused_rank{rank}.txt").read_text()
    assert not (out / "ram_stage.json").exists()
