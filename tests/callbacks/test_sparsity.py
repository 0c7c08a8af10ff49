"""TaskVectorSparsityCallback in real training runs: TRL GRPO (full, beta > 0, LoRA), RLOO and a plain Trainer.

Tiny Qwen2 models built from configs with a character tokenizer train a few steps on the CPU. Every run checks that
the metrics reach ``log_history`` and the TensorBoard event file, that the last measurement equals ``ram-trl
analyze`` of the saved checkpoint exactly (same dtype, same eps), and the stage manifest; two GRPO stages then merge
from their manifests alone.
"""

from __future__ import annotations

import hashlib
import inspect
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("peft")
pytest.importorskip("tensorboard")

from datasets import Dataset  # noqa: E402
from peft import LoraConfig  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator  # noqa: E402
from trl import GRPOConfig, GRPOTrainer, RLOOConfig, RLOOTrainer  # noqa: E402

import ram_trl  # noqa: E402
from ram_trl.callbacks.preview import MergePreviewCallback  # noqa: E402
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback  # noqa: E402
from ram_trl.errors import ConfigError  # noqa: E402
from ram_trl.stage.manifest import MANIFEST_NAME, fingerprint_checkpoint, read_manifest  # noqa: E402
from ram_trl.synthetic import make_base_checkpoint  # noqa: E402
from tests.helpers import (  # noqa: E402
    RL_STEPS,
    TELEMETRY,
    assert_stage_manifest,
    assert_telemetry_is_the_analysis,
    assert_telemetry_logged,
    distinct_char_count,
    leftovers,
    rl_config,
    rl_prompts,
    telemetry_entries,
    tensorboard_scalars,
    train_rl,
)

pytestmark = [pytest.mark.slow]

P = TELEMETRY
STEPS = RL_STEPS


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_base_checkpoint(
        tmp_path_factory.mktemp("base") / "base", hidden_size=32, num_layers=2, intermediate_size=64
    )


def rl_args(cls, out: Path, **overrides):
    """:func:`tests.helpers.rl_config` with TensorBoard reports (where the metrics must also arrive)."""
    return rl_config(cls, out, **{"report_to": ["tensorboard"], **overrides})


def grpo_run(base: Path, out: Path, callback: TaskVectorSparsityCallback, **overrides) -> GRPOTrainer:
    peft_config = overrides.pop("peft_config", None)
    config = rl_args(GRPOConfig, out, **overrides)
    return train_rl(GRPOTrainer, base, config, callback, distinct_char_count, rl_prompts(4), peft_config)


def logged(trainer) -> list[dict]:
    """The log_history entries carrying telemetry."""
    return telemetry_entries(trainer.state.log_history)


def check_run(trainer, callback: TaskVectorSparsityCallback, base: Path, out: Path, kind: str) -> dict:
    """The assertions every run shares; returns the analysis of the saved agent."""
    history = trainer.state.log_history
    last = assert_telemetry_logged(history, callback.tracker.last, out, [2, STEPS])[-1]
    # the last measurement is ram-trl analyze of the saved agent (bf16, eps 1e-5) to the element
    result = assert_telemetry_is_the_analysis(last, base, out, kind)
    manifest = assert_stage_manifest(out, base, last, history, kind, STEPS)
    assert manifest.trainer == type(trainer).__name__
    assert {"torch", "transformers", "ram_trl"} <= set(manifest.versions)
    return result


def test_grpo_full_finetune_base_from_disk(base, tmp_path):
    out = tmp_path / "grpo"
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="coding", domain="code", save_dtype="bfloat16")
    trainer = grpo_run(base, out, callback)
    assert callback.tracker.base_description.startswith(f"base checkpoint {base}")
    assert callback.tracker.state_bytes == 0
    check_run(trainer, callback, base, out, "full")
    manifest = read_manifest(out)
    assert manifest.stage == "coding" and manifest.domain == "code" and manifest.base_model == str(base)
    assert manifest.processes == 1  # how many processes trained it
    assert "reward" in manifest.rewards
    last = logged(trainer)[-1]
    # the telemetry logs through GRPOTrainer.log, which adds the rewards stored since its last entry to ours (the
    # measurement comes before the trainer's own entry of the step); the manifest holds the last logged reward
    assert [e for e in trainer.state.log_history if "reward" in e][-1] is last
    assert last["reward"] == manifest.rewards["reward"]
    # fp32 training: the live task vector is denser than the bf16 checkpoint
    assert last[f"{P}density"] >= last[f"{P}density_saved"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    AutoTokenizer.from_pretrained(out)


def test_grpo_reference_model_is_the_base(base, tmp_path):
    out = tmp_path / "grpo_beta"
    callback = TaskVectorSparsityCallback(base_model=base, save_dtype="bfloat16")
    trainer = grpo_run(base, out, callback, beta=0.04)
    assert trainer.ref_model is not None
    assert callback.tracker.base_description == "reference model"
    check_run(trainer, callback, base, out, "full")


def test_grpo_lora_needs_no_base(base, tmp_path):
    out = tmp_path / "grpo_lora"
    callback = TaskVectorSparsityCallback(save_dtype="bfloat16")
    peft_config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"], task_type="CAUSAL_LM"
    )
    trainer = grpo_run(base, out, callback, peft_config=peft_config)
    assert callback.tracker.base_description == "frozen base weights of the PEFT model"
    assert callback.tracker.state_bytes == 0
    result = check_run(trainer, callback, base, out, "lora")
    assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    last = logged(trainer)[-1]
    # only the adapted modules and lm_head move
    assert last[f"{P}module/mlp_up/density"] == 0.0 and last[f"{P}module/attn_k/density"] == 0.0
    assert last[f"{P}module/attn_q/density"] > 0.0 and last[f"{P}module/lm_head/density"] > 0.0
    assert result["agents"][0]["kind"] == "lora"


def test_rloo(base, tmp_path):
    out = tmp_path / "rloo"
    callback = TaskVectorSparsityCallback(base_model=base, save_dtype="bfloat16")
    trainer = train_rl(RLOOTrainer, base, rl_args(RLOOConfig, out), callback, distinct_char_count, rl_prompts(4))
    # RLOO's default beta > 0 loads a reference model
    assert callback.tracker.base_description == "reference model"
    check_run(trainer, callback, base, out, "full")


@pytest.mark.parametrize("trainer_cls, config_cls", [(GRPOTrainer, GRPOConfig), (RLOOTrainer, RLOOConfig)])
def test_the_trainers_log_adds_its_rewards_to_the_telemetry_entries(base, tmp_path, trainer_cls, config_cls):
    """The callback logs through the trainer's public ``log``; TRL's override adds the average of the metrics it
    stored since its last entry and clears its store (docs/telemetry.md). Measured every 3 steps and logged every 2
    over 7 steps, the rewards are those of the same run logged every step, averaged over the windows between
    entries: 1-2 (the trainer's), 3 (ours), 4 (the trainer's), 5-6 (ours), 7 (ours); every logger sees them."""

    def run(out: Path, callbacks: list, **overrides) -> Any:
        trainer = trainer_cls(
            model=str(base),
            reward_funcs=distinct_char_count,
            args=rl_args(config_cls, out, max_steps=7, **overrides),
            train_dataset=rl_prompts(4),
            callbacks=callbacks,
        )
        for callback in callbacks:
            callback.bind(trainer)
        trainer.train()
        return trainer

    every_step = run(tmp_path / "alone", [], logging_steps=1)
    reward = {e["step"]: e["reward"] for e in every_step.state.log_history if "reward" in e}
    assert sorted(reward) == list(range(1, 8))
    out = tmp_path / "measured"
    callback = TaskVectorSparsityCallback(base_model=base, every_n_steps=3, save_agent=False, write_stage=False)
    measured = run(out, [callback])

    def mean(*steps: int) -> float:
        return sum(reward[s] for s in steps) / len(steps)

    found = [(e["step"], f"{P}density" in e, e["reward"]) for e in measured.state.log_history if "reward" in e]
    assert found == [(2, False, mean(1, 2)), (3, True, mean(3)), (4, False, mean(4)), (6, True, mean(5, 6)),
                     (7, True, mean(7))]  # fmt: skip
    # the trainer's own entries at its logging steps (without the callback its train-end summary entry would carry
    # step 7's rewards: TRL's log adds its store to every entry)
    assert [e["step"] for e in measured.state.log_history if "loss" in e] == [2, 4, 6]
    entries = logged(measured)
    assert [e["step"] for e in entries] == [3, 6, 7]
    assert entries[-1] == {**entries[-1], **callback.tracker.last}
    assert [s for s, _ in tensorboard_scalars(out, "reward")] == [2, 3, 4, 6, 7]
    assert [s for s, _ in tensorboard_scalars(out, f"{P}density_saved")] == [3, 6, 7]


def test_plain_trainer_snapshot_base(base, tmp_path):
    out = tmp_path / "sft"
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = [tokenizer("abcabcab")["input_ids"][:8] for _ in range(8)]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 8 for _ in ids]})
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    callback = TaskVectorSparsityCallback(every_n_steps=1)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-3,
        report_to=["tensorboard"],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.bind(trainer)
    trainer.train()
    assert callback.tracker.base_description == "in-memory snapshot taken at train begin"
    total = sum(p.numel() * 4 for p in model.parameters())
    assert callback.tracker.state_bytes == total
    entries = logged(trainer)
    assert [e["step"] for e in entries] == [1, 2]
    assert entries[-1][f"{P}state_mb"] == total / 2**20
    assert [s for s, _ in tensorboard_scalars(out, f"{P}density")] == [1, 2]
    result = ram_trl.analyze(base, [out], progress=False, figures=False)
    assert entries[-1][f"{P}density_saved"] == result["agents"][0]["density"]
    manifest = read_manifest(out)
    assert manifest.trainer == "Trainer" and manifest.rewards == {} and manifest.steps == 2
    assert manifest.base_fingerprint == fingerprint_checkpoint(base)


def test_two_stages_then_merge_from_manifests(base, tmp_path):
    first, second = tmp_path / "stage1", tmp_path / "stage2"
    grpo_run(base, first, TaskVectorSparsityCallback(base_model=base, stage_name="first"))
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="second", prior_stages=[first])
    trainer = grpo_run(base, second, callback, seed=1, learning_rate=5e-4)
    last = logged(trainer)[-1]
    # the overlap metrics are the counts of ram-trl analyze over [first, second] (agent 1 is this run)
    result = ram_trl.analyze(base, [first, second], eps=1e-5, r=0.1, alpha=2.0, progress=False, figures=False)
    agent = result["agents"][1]
    assert last[f"{P}prior/overlap"] == agent["shared"] / agent["active"]
    pairwise_share = agent["overlap_shares"][1]
    assert last[f"{P}prior/first/overlap"] == pairwise_share
    rho = agent["rho"]
    assert last[f"{P}prior/rho"] == (math.inf if rho == "inf" else rho)
    assert last[f"{P}prior/lambda_ram_plus"] == agent["lambda"]["ram_plus"]
    assert last[f"{P}prior/lambda_ram_plus_soft"] == agent["lambda"]["ram_plus_soft"]
    assert read_manifest(second).extra["telemetry"]["prior_stages"] == ["first"]
    config = {
        "merge_method": "ram_plus",
        "base_model": str(base),
        "models": [{"stage": str(first)}, {"stage": str(second)}],
    }
    merged = tmp_path / "merged"
    report = ram_trl.merge(config, merged, progress=False)
    assert [a["name"] for a in report["agents"]] == ["first", "second"]
    model = AutoModelForCausalLM.from_pretrained(merged)
    assert sum(p.numel() for p in model.parameters()) == result["total_elements"]


def test_callback_without_trainer_fails_clearly(base, tmp_path):
    callback = TaskVectorSparsityCallback(base_model=base)
    trainer = GRPOTrainer(
        model=str(base),
        reward_funcs=distinct_char_count,
        args=rl_args(GRPOConfig, tmp_path / "x"),
        train_dataset=rl_prompts(4),
        callbacks=[callback],
    )
    with pytest.raises(ConfigError, match="bind"):
        trainer.train()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"every_n_steps": 0}, "every_n_steps"),
        ({"save_dtype": "int8"}, "save_dtype"),
        ({"eps": -1.0}, "eps"),
        ({"base_model": "/nonexistent/base"}, "does not exist"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        TaskVectorSparsityCallback(**kwargs)


@pytest.mark.parametrize("cls", [TaskVectorSparsityCallback, MergePreviewCallback])
def test_arguments_after_base_model_are_keyword_only(cls):
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[:2]] == ["trainer", "base_model"]
    kinds = {p.name: p.kind for p in params[2:]}
    assert set(kinds.values()) <= {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD}, kinds
    with pytest.raises(TypeError, match="positional"):
        TaskVectorSparsityCallback(None, None, 5)


HUB = """
from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback
from ram_trl.errors import ConfigError

callback = TaskVectorSparsityCallback(base_model="acme/tiny-base")
print(callback.base_reference)  # what the stage manifest records: the id as given, and the commit
print(callback.base_model)
try:
    TaskVectorSparsityCallback(base_model="acme/not-cached")
except ConfigError as exc:
    print(exc)
"""


def test_hub_repository_id_as_base_from_the_local_cache(base, tmp_path):
    # a Hub id resolves through huggingface_hub.snapshot_download: offline, from the local cache; one that is not
    # cached is refused with the command that downloads it
    repo = tmp_path / "hub" / "models--acme--tiny-base"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(base, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    done = subprocess.run([sys.executable, "-c", HUB], env=env, capture_output=True, text=True, check=True)
    recorded, resolved, refused = done.stdout.strip().splitlines()[-3:]
    assert recorded == str(("acme/tiny-base", "0" * 40))
    assert resolved == str(snapshot)
    assert refused.startswith("base_model: 'acme/not-cached' is not a local path and the Hub repository")
    assert refused.endswith("fetch it with `hf download acme/not-cached`")


def test_resumed_run_without_a_base_fails_clearly(base, tmp_path):
    from transformers import TrainerControl, TrainerState

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    args = TrainingArguments(output_dir=str(tmp_path / "resumed"), report_to=[], use_cpu=True)
    trainer = Trainer(model=model, args=args)
    callback = TaskVectorSparsityCallback(trainer=trainer)
    with pytest.raises(ConfigError, match="resumes at step 5.*base_model=PATH"):
        callback.on_train_begin(args, TrainerState(global_step=5), TrainerControl(), model=model)
    # with the base on disk, resuming is fine
    callback = TaskVectorSparsityCallback(trainer=trainer, base_model=base)
    callback.on_train_begin(args, TrainerState(global_step=5), TrainerControl(), model=model)
    assert callback.tracker.base_description.startswith("base checkpoint")


def test_save_is_atomic_a_failure_midway_leaves_no_agent(base, tmp_path, monkeypatch):
    """The end-of-run save writes to a temporary sibling and commits at once: a failure after the weights and the
    tokenizer were written (a full disk while writing the manifest) leaves neither a half-written agent directory
    nor a temporary one; the error names the directory."""
    import errno

    import ram_trl.callbacks.sparsity as callbacks
    from ram_trl.errors import OutputError

    def full_disk(manifest, directory):
        assert (Path(directory) / "model.safetensors").is_file()  # the weights were written: we are midway
        raise OSError(errno.ENOSPC, "No space left on device", str(directory))

    import ram_trl.stage.save as stage_save

    monkeypatch.setattr(callbacks, "write_manifest", full_disk)
    monkeypatch.setattr(stage_save, "write_manifest", full_disk)  # the agent's save writes its manifest there
    out = tmp_path / "agent"
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="s")
    with pytest.raises(OutputError, match=f"agent directory {out}.*No space left"):
        grpo_run(base, out, callback, max_steps=1, report_to=[])
    assert list(out.iterdir()) == []  # the trainer made output_dir; nothing of the agent reached it
    assert leftovers(out) == []


def test_save_into_an_existing_output_dir_is_all_or_nothing(base, tmp_path, monkeypatch):
    """A trainer's output_dir that already holds files (its logs, a previous agent and manifest): a failed save
    leaves every previous file as it was; a successful one replaces the agent, keeps the trainer's other files and
    leaves no lock file."""
    from ram_trl.output import LOCK_FILE

    out = tmp_path / "agent"
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="first")
    grpo_run(base, out, callback, max_steps=1, report_to=[])
    (out / "notes.txt").write_text("the user's file\n")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert {"model.safetensors", MANIFEST_NAME, "notes.txt"} <= set(before)

    def broken(self, *args, **kwargs):
        raise RuntimeError("tokenizer save failed")

    processing = type(AutoTokenizer.from_pretrained(base))
    with monkeypatch.context() as patch:
        patch.setattr(processing, "save_pretrained", broken)
        with pytest.raises(RuntimeError, match="tokenizer save failed"):
            grpo_run(
                base, out, TaskVectorSparsityCallback(base_model=base, stage_name="second"), max_steps=1, report_to=[]
            )
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert read_manifest(out).stage == "first"
    assert leftovers(out) == []

    grpo_run(base, out, TaskVectorSparsityCallback(base_model=base, stage_name="third"), max_steps=1, report_to=[])
    assert read_manifest(out).stage == "third"
    assert (out / "notes.txt").read_text() == "the user's file\n"
    assert not (out / LOCK_FILE).exists()
    assert not any(p.name.startswith(".ram-trl") for p in out.iterdir())
    assert leftovers(out) == []


def test_output_dir_holding_the_base_is_refused_before_training(base, tmp_path):
    """Saving the agent into the base's own directory would overwrite the base: refused at train begin."""
    from ram_trl.errors import OutputError

    before = {p.name: p.stat().st_mtime_ns for p in base.iterdir()}
    callback = TaskVectorSparsityCallback(base_model=base)
    with pytest.raises(OutputError, match="overlaps the base model"):
        grpo_run(base, base, callback, max_steps=1, report_to=[])
    assert {p.name: p.stat().st_mtime_ns for p in base.iterdir()} == before


# ---------------------------------------------------------------------------------------------------------------
# The stage contract (issues 24 and 26): what the manifest describes is what is on disk


def test_output_dir_of_a_prior_stage_is_refused_before_training(base, tmp_path):
    from ram_trl.errors import OutputError

    first = tmp_path / "first"
    grpo_run(base, first, TaskVectorSparsityCallback(base_model=base, stage_name="first"), max_steps=1, report_to=[])
    before = {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()}
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="second", prior_stages=[first])
    with pytest.raises(OutputError, match=f"overlaps the prior stage at {first}"):
        grpo_run(base, first, callback, max_steps=1, report_to=[])
    assert {p.name: p.read_bytes() for p in first.iterdir() if p.is_file()} == before


def test_trainer_save_model_after_the_callback_is_refused_by_the_merge(base, tmp_path):
    """The collision of issue 24: the callback saves the bf16 agent, trainer.save_model then writes the float32
    model over it; the manifest's digests catch it and the merge refuses, naming the file."""
    out = tmp_path / "agent"
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="s", save_dtype="bfloat16")
    trainer = grpo_run(base, out, callback, report_to=[])
    manifest = read_manifest(out)
    assert manifest.kind == "full" and sorted(manifest.files) == ["model.safetensors"]
    assert manifest.files == {n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in manifest.files}
    ram_trl.analyze(base, [out], progress=False, figures=False)  # intact: accepted
    trainer.save_model(str(out))
    with pytest.raises(ConfigError, match=rf"{out / 'model.safetensors'} no longer matches"):
        ram_trl.analyze(base, [out], progress=False, figures=False)
    # the documented way: the trainer's own save goes to a directory of its own
    fresh = tmp_path / "fresh"
    trainer = grpo_run(base, fresh, TaskVectorSparsityCallback(base_model=base, stage_name="s"), report_to=[])
    trainer.save_model(str(fresh / "trainer_model"))
    ram_trl.analyze(base, [fresh], progress=False, figures=False)


def test_a_lora_save_into_a_full_agent_directory_leaves_only_the_adapter(base, tmp_path):
    out = tmp_path / "agent"
    grpo_run(base, out, TaskVectorSparsityCallback(base_model=base, stage_name="full"), max_steps=1, report_to=[])
    assert (out / "model.safetensors").is_file()
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="lora")
    grpo_run(base, out, callback, max_steps=1, report_to=[], peft_config=lora)
    manifest = read_manifest(out)
    assert manifest.kind == "lora" and not (out / "model.safetensors").exists()
    assert sorted(manifest.files) == ["adapter_config.json", "adapter_model.safetensors"]
    assert manifest.files == {n: hashlib.sha256((out / n).read_bytes()).hexdigest() for n in manifest.files}
    ram_trl.analyze(base, [out], progress=False, figures=False)


def test_foreign_weights_in_output_dir_are_refused_before_training(base, tmp_path):
    from ram_trl.errors import OutputError

    out = tmp_path / "agent"
    out.mkdir()
    (out / "adapter_model.safetensors").write_bytes(b"someone else's")
    with pytest.raises(OutputError, match="adapter_model.safetensors, which no ram_stage.json there describes"):
        grpo_run(base, out, TaskVectorSparsityCallback(base_model=base), max_steps=1, report_to=[])
    assert (out / "adapter_model.safetensors").read_bytes() == b"someone else's"


def test_save_agent_false_writes_a_manifest_describing_no_weights(base, tmp_path):
    out = tmp_path / "agent"
    callback = TaskVectorSparsityCallback(base_model=base, stage_name="s", save_agent=False)
    trainer = grpo_run(base, out, callback, max_steps=1, report_to=[])
    assert read_manifest(out).files == {}
    trainer.save_model(str(out))  # whatever lands there is not the manifest's
    with pytest.raises(ConfigError, match="describes no saved agent"):
        ram_trl.analyze(base, [out], progress=False, figures=False)


def _one_step_trainer(base, out, data, callbacks):
    """A plain transformers Trainer of one CPU step on ``data`` with ``callbacks``, and its arguments."""
    args = TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=1, report_to=[], save_strategy="no", use_cpu=True
    )
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    trainer = Trainer(
        model=model, args=args, train_dataset=data, data_collator=default_data_collator, callbacks=callbacks
    )
    return trainer, args


def test_an_agent_that_overflows_save_dtype_is_not_saved(base, tmp_path):
    """A float16 save of weights beyond float16's range: refused in one line, nothing written, no manifest."""
    from transformers import TrainerCallback

    from ram_trl.errors import NonFiniteError

    class Explode(TrainerCallback):  # the run "diverges" on its last step, before the stage is saved
        def on_train_end(self, args, state, control, model=None, **kwargs):
            with torch.no_grad():
                next(model.parameters()).fill_(1e6)

    out = tmp_path / "sft"
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = [tokenizer("abcabcab")["input_ids"][:8] for _ in range(4)]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 8 for _ in ids]})
    callback = TaskVectorSparsityCallback(base_model=base, save_dtype="float16")
    trainer, args = _one_step_trainer(base, out, data, [Explode(), callback])
    callback.bind(trainer)
    with pytest.raises(NonFiniteError, match=r"NaN/Inf values in float16 .*nothing was saved"):
        trainer.train()
    assert not (out / MANIFEST_NAME).exists() and not (out / "model.safetensors").exists()


def test_two_callbacks_writing_one_output_dir_are_refused_naming_both(base, tmp_path):
    out = tmp_path / "sft"
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = [tokenizer("abcabcab")["input_ids"][:8] for _ in range(4)]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 8 for _ in ids]})
    first = TaskVectorSparsityCallback(base_model=base, stage_name="coding")
    second = TaskVectorSparsityCallback(base_model=base, stage_name="tools", prefix="other/")
    trainer, args = _one_step_trainer(base, out, data, [first, second])
    first.bind(trainer)
    second.bind(trainer)
    with pytest.raises(ConfigError, match=r"2 TaskVectorSparsityCallback instances \(stages 'coding' and 'tools'\)"):
        trainer.train()
    assert not (out / MANIFEST_NAME).exists()
    second.save_agent = second.write_stage = False  # one writer: measuring twice is allowed
    first._check_one_writer(args)


def test_a_base_model_the_policy_does_not_start_from_is_reported_before_training(base, tmp_path):
    from safetensors.torch import load_file, save_file

    from ram_trl.errors import NonFiniteError

    other = tmp_path / "other_base"
    shutil.copytree(base, other)
    tensors = load_file(str(other / "model.safetensors"))
    name = fingerprint_checkpoint(base).tensors[-1]
    tensors[name] = tensors[name] + 0.5  # same architecture, other weights
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    callback = TaskVectorSparsityCallback(base_model=other, stage_name="s")
    with pytest.warns(UserWarning, match=rf"base_model {other}: tensor '{name}' differs from the policy's"):
        grpo_run(base, tmp_path / "out", callback, max_steps=1, report_to=[])
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(other / "model.safetensors"), metadata={"format": "pt"})
    callback = TaskVectorSparsityCallback(base_model=other, stage_name="s")
    with pytest.raises(NonFiniteError, match=rf"base_model {other}: tensor '{name}' holds NaN/Inf"):
        grpo_run(base, tmp_path / "out2", callback, max_steps=1, report_to=[])
