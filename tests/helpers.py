"""Builders and assertions shared by the test modules (fixtures built from them live in ``tests/conftest.py``).

Test modules import from here, never from each other.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ram_trl.io import safetensors_io
from ram_trl.statistics.magnitude import MagnitudeStatistics
from tests._launch import free_port, run_job

# ---------------------------------------------------------------------------------------------------------------
# Golden inputs of the engine and analysis tests

F = torch.float32
# The seven elements of tests/methods/test_ram.py (same activity pattern, dyadic values so that base + tau is
# exact in float32), split over two tensors: A = e0..e3, B = e4..e6. e0: no agent; e1: agent 0 only; e2: agents
# 0, 1; e3: all three; e4: agent 0 at exactly eps (inactive); e5: agent 1 only; e6: agent 0 only.
TAUS = torch.tensor(
    [
        [0.0, 0.5, 0.25, 0.375, 1e-5, 0.0, 0.125],
        [0.0, 0.0, 0.5, -0.375, 0.0, 2e-5, 0.0],
        [0.0, 0.0, 0.0, 0.75, 0.0, 0.0, 0.0],
    ],
    dtype=F,
)
BASE = torch.tensor([1.0, -1.0, 0.5, 2.0, 0.0, 0.0, 3.0], dtype=F)


# ---------------------------------------------------------------------------------------------------------------
# Tiny float32 checkpoints (a base and sparse agents) and merge configs

HIDDEN = 8
VOCAB = 16
INTER = 24
EMBED = "model.embed_tokens.weight"
UP = "model.layers.0.mlp.up_proj.weight"
BIAS = "model.layers.0.mlp.up_proj.bias"
DOWN = "model.layers.0.mlp.down_proj.weight"
ALL_METHODS = ("dare_linear", "dare_ties", "linear", "ram", "ram_plus", "ram_plus_soft", "task_arithmetic", "ties")


# ---------------------------------------------------------------------------------------------------------------
# Building tiny checkpoints


def base_tensors(seed: int = 0, vocab: int = VOCAB) -> dict[str, torch.Tensor]:
    """A tiny float32 'model': an embedding [vocab, hidden], a matrix and its bias, and a second matrix."""
    g = torch.Generator().manual_seed(seed)
    return {
        EMBED: torch.randn(vocab, HIDDEN, generator=g),
        UP: torch.randn(INTER, HIDDEN, generator=g),
        BIAS: torch.randn(INTER, generator=g),
        DOWN: torch.randn(HIDDEN, INTER, generator=g),
    }


def perturb(tensors: dict[str, torch.Tensor], seed: int, fraction: float = 0.1, scale: float = 0.05):
    """``tensors`` plus a sparse random task vector (about ``fraction`` of the elements changed)."""
    g = torch.Generator().manual_seed(1000 + seed)
    out = {}
    for name, value in tensors.items():
        mask = torch.rand(value.shape, generator=g) < fraction
        noise = torch.randn(value.shape, generator=g) * scale
        out[name] = value + mask * noise
    return out


def save_checkpoint(
    path: Path, tensors: dict[str, torch.Tensor], vocab_size: int = VOCAB, *, config: dict | None = None
) -> Path:
    """A Hugging Face-style directory: model.safetensors + config.json (a tiny Llama's unless ``config`` is given)."""
    path.mkdir(parents=True)
    save_file(
        {k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    if config is None:
        config = {"model_type": "llama", "vocab_size": vocab_size, "hidden_size": HIDDEN, "torch_dtype": "float32"}
    (path / "config.json").write_text(json.dumps(config))
    return path


#: The ``config.json`` of the golden inputs' checkpoints.
GOLDEN_CONFIG = {"vocab_size": 7}


def write_golden(root: Path) -> tuple[Path, list[Path]]:
    """The golden inputs as checkpoints: ``root/base`` holds :data:`BASE` and ``root/agent{t}`` ``BASE + TAUS[t]``
    (t = 0, 1, 2), each as tensors ``A`` (e0..e3) and ``B`` (e4..e6) with :data:`GOLDEN_CONFIG`.

    Returns:
        `tuple[Path, list[Path]]`: The base and the three agents.
    """
    checkpoints = [
        save_checkpoint(root / name, {"A": flat[:4], "B": flat[4:]}, config=GOLDEN_CONFIG)
        for name, flat in [("base", BASE), *((f"agent{t}", BASE + tau) for t, tau in enumerate(TAUS))]
    ]
    return checkpoints[0], checkpoints[1:]


def load_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


@dataclass
class Checkpoints:
    root: Path
    base: Path
    agents: list[Path]
    base_tensors: dict[str, torch.Tensor]
    agent_tensors: list[dict[str, torch.Tensor]]


def make_checkpoints(
    root: Path, num_agents: int = 2, *, seed: int = 0, fraction: float = 0.1, overrides: dict | None = None
) -> Checkpoints:
    """A base and ``num_agents`` agents (base + sparse perturbations) under ``root``.

    ``overrides`` maps an agent index to a function ``tensors -> tensors`` applied before saving.
    """
    base = base_tensors(seed)
    base_dir = save_checkpoint(root / "base", base)
    agents, agent_tensors = [], []
    for t in range(num_agents):
        tensors = perturb(base, seed * 100 + t, fraction)
        if overrides and t in overrides:
            tensors = overrides[t](tensors)
        agent_tensors.append(tensors)
        agents.append(save_checkpoint(root / f"agent{t}", tensors))
    return Checkpoints(root, base_dir, agents, base, agent_tensors)


def open_ckpts(ckpts: Checkpoints) -> tuple[Any, list[Any]]:
    """The base and the agents of ``ckpts`` opened as the merge opens them (``base model``, ``agent i``)."""
    from ram_trl.io.checkpoint import open_checkpoint

    base = open_checkpoint(ckpts.base, "base model")
    return base, [open_checkpoint(a, f"agent {i}") for i, a in enumerate(ckpts.agents)]


def plan_for(base: Any, agents: list[Any], **settings: Any) -> Any:
    """:func:`ram_trl.merging.planner.build_plan` with a plain merge's settings unless ``settings`` change them: no output
    dtype, shapes must match, no global statistics, no magnitude trim."""
    from ram_trl.merging.planner import build_plan

    plain = {"out_dtype": None, "shape_mismatch": "error", "needs_statistics": False, "trims_by_magnitude": False}
    return build_plan(base, agents, **{**plain, **settings})


def run_context(
    ckpts: Checkpoints, method: str = "ram_plus", *, chunk_budget: int | None = None, **config: Any
) -> Any:
    """The :class:`~ram_trl.merging.context.RunContext` the engine builds for a single-process CPU merge of ``ckpts`` (no
    progress bars; set ``run.reader`` to a :class:`~ram_trl.io.safetensors_io.RowReader` before running a pass).
    ``chunk_budget`` (bytes) cuts the tensors into more chunks; ``config`` goes into :func:`config_for`."""
    from ram_trl.distributed import DistContext
    from ram_trl.merging.config.resolve import resolve_config
    from ram_trl.merging.config.schema import load_config
    from ram_trl.merging.context import MergeOptions, MergeState, RunContext
    from ram_trl.merging.engine import prepare, run_copy
    from ram_trl.statistics import OverlapStatistics

    resolved = run_copy(resolve_config(load_config(config_for(ckpts, method, **config))[0]))
    options = MergeOptions(progress=False, **({} if chunk_budget is None else {"chunk_budget": chunk_budget}))
    base, agents, plan = prepare(resolved, ckpts.root / "merged", options)
    return RunContext(
        resolved=resolved,
        options=options,
        base=base,
        agents=agents,
        plan=plan,
        dist=DistContext.from_env("cpu"),
        state=MergeState(stats=OverlapStatistics.zeros(len(agents))),
        device=torch.device("cpu"),
        tasks=list(plan.tasks),
    )


def with_position_ids(root: Path) -> tuple[Any, list[Any]]:
    """A base and one equal agent holding :func:`base_tensors` plus an integer ``model.position_ids`` (copied to the
    output, never merged), opened."""
    from ram_trl.io.checkpoint import open_checkpoint

    tensors = {**base_tensors(), "model.position_ids": torch.arange(6)}
    base = open_checkpoint(save_checkpoint(root / "base", tensors), "base model")
    return base, [open_checkpoint(save_checkpoint(root / "agent", tensors), "agent 0")]


def config_for(
    ckpts: Checkpoints,
    method: str = "task_arithmetic",
    *,
    agents: list[Path] | None = None,
    agent_parameters: dict[str, Any] | None = None,
    parameters: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    models = [
        {"model": str(a), **({"parameters": dict(agent_parameters)} if agent_parameters else {})}
        for a in (ckpts.agents if agents is None else agents)
    ]
    config: dict[str, Any] = {"merge_method": method, "base_model": str(ckpts.base), "models": models}
    if parameters:
        config["parameters"] = parameters
    config.update(extra)
    return config


# ---------------------------------------------------------------------------------------------------------------
# Assertions on outputs and inputs


def snapshot(root: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``root``: bytes and modification time."""
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def leftovers(out: Path) -> list[str]:
    """Temporary or backup siblings the engine may create next to ``out``."""
    return sorted(p.name for p in out.parent.glob(f".{out.name}.ram-trl-*"))


def dead_pid() -> int:
    """The process id of a process that has exited (for leftovers of a killed run)."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def assert_no_output(out: Path) -> None:
    assert not out.exists(), f"{out} was left behind"
    assert leftovers(out) == [], f"temporary siblings left behind: {leftovers(out)}"


def failing_writer(monkeypatch, exception: type[BaseException], succeed: int = 1) -> list[int]:
    """Make the shard writer (``ShardFile.write_rows``) raise ``exception`` after ``succeed`` successful writes."""
    original = safetensors_io.ShardFile.write_rows
    calls = [0]

    def write_rows(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] > succeed:
            raise exception("simulated failure while writing")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(safetensors_io.ShardFile, "write_rows", write_rows)
    return calls


# ---------------------------------------------------------------------------------------------------------------
# Fisher files, TensorBoard logs, LoRA models, multi-process merges


def random_fisher(state: dict[str, torch.Tensor], seed: int, zero_share: float = 0.3) -> dict[str, torch.Tensor]:
    """Non-negative float32 values spanning several orders of magnitude, ``zero_share`` of them exactly zero."""
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in state.items():
        if not value.is_floating_point():
            continue
        magnitude = (
            torch.rand(value.shape, generator=generator)
            * 10 ** torch.randint(-8, 1, value.shape, generator=generator).float()
        )
        zero = torch.rand(value.shape, generator=generator) < zero_share
        out[name] = torch.where(zero, torch.zeros_like(magnitude), magnitude).float()
    return out


def tensorboard_scalars(out: Path, tag: str) -> list[tuple[int, float]]:
    """Steps and values of a logged metric in the TensorBoard event files (the integration adds ``train/``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # optional extra

    tag = f"train/{tag}"
    files = sorted(out.rglob("events.out.tfevents.*"))
    assert files, f"no TensorBoard event file under {out}"
    values = []
    for file in files:
        acc = EventAccumulator(str(file.parent))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            values += [(e.step, e.value) for e in acc.Scalars(tag)]
    return values


def qwen_model(seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny float32 Qwen2 causal LM (2 layers, width 32, vocabulary 96, untied), seeded."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "intermediate_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 96,
        "tie_word_embeddings": False,
    }
    config = Qwen2Config(**{**settings, **overrides})
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).float()


def save_base(model: torch.nn.Module, path: Path) -> Path:
    """``model.save_pretrained(path)``; returns ``path``."""
    model.save_pretrained(path)
    return path


def lora_adapter(model: torch.nn.Module, path: Path, seed: int = 1, **lora: Any):
    """A PEFT LoRA adapter with random (non-zero) B on ``model``, saved to ``path``; returns the PEFT model."""
    import peft

    torch.manual_seed(seed)
    config = peft.LoraConfig(init_lora_weights=False, **lora)  # random B: a non-zero delta
    peft_model = peft.get_peft_model(model, config)
    peft_model.save_pretrained(path)
    return peft_model


def dense_lora_deltas(peft_model) -> dict[str, torch.Tensor]:
    """PEFT's own dense delta per base tensor name (get_delta_weight), plus modules_to_save values."""
    deltas = {}
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "get_delta_weight") and "default" in getattr(module, "lora_A", {}):
            deltas[f"{name}.weight"] = module.get_delta_weight("default").detach().float()
    return deltas


def launch_merge(
    nproc: int, config: Path, out: Path, *extra: str, launcher: str = "torchrun"
) -> subprocess.CompletedProcess:
    """``ram-trl merge CONFIG OUT`` on ``nproc`` CPU processes (torchrun, or ``accelerate launch``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    port = free_port()
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
        command += [f"--master_port={port}", "-m", "ram_trl"]
    else:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", f"--num_processes={nproc}"]
        command += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
        command += [f"--main_process_port={port}", "-m", "ram_trl"]
    command += ["merge", str(config), str(out), "--no-progress", *extra]
    return run_job(command, port, env=env, capture_output=True, text=True, timeout=300)


def distinct_chars(completions, **kwargs) -> list[float]:
    """A reward a tiny random model varies on: the share of distinct characters among 8 in each completion.

    Reward functions given by import path (``tests.helpers:distinct_chars``) in recipe stages and merge previews.
    """
    return [len(set(c if isinstance(c, str) else str(c))) / 8 for c in completions]


def distinct_char_count(completions, **kwargs) -> list[float]:
    """A reward a tiny random model varies on: the number of distinct characters in each completion."""
    return [float(len(set(c))) for c in completions]


def preview_tasks() -> list[Any]:
    """Validation prompts of the distributed merge-preview runs: stages ``first`` and ``second``, 6 prompts each,
    scored with :func:`distinct_chars`."""
    from ram_trl.evaluation.scoring import EvalTask

    reward = "tests.helpers:distinct_chars"
    return [
        EvalTask("first", [{"prompt": f"a{i}"} for i in range(6)], [reward]),
        EvalTask("second", [{"prompt": f"b{i}"} for i in range(6)], [reward]),
    ]


#: Prompts of the tiny RL runs of the callback and preview tests (repeated to fill the dataset).
RL_PROMPTS = ("ab", "cd", "ef", "gh")
#: Steps of those runs unless a test says otherwise.
RL_STEPS = 3


def rl_config(cls: type, out: Path, **overrides: Any) -> Any:
    """A tiny TRL RL trainer config for the callback and preview tests: 4 prompts a device batch, 4 generations
    of at most 8 tokens, :data:`RL_STEPS` steps, a log every 2, learning rate 1e-3, on the CPU in float32, seed 0,
    no reports and no checkpoints.

    Args:
        cls (`type`): The config class (``trl.GRPOConfig``, ``trl.RLOOConfig``).
        out (`Path`): Its ``output_dir``.
        **overrides: Settings that replace (or add to) the above.

    Returns:
        The config.
    """
    settings: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=RL_STEPS,
        logging_steps=2,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    settings.update(overrides)
    return cls(**settings)


def rl_prompts(repeats: int, prompts: tuple[str, ...] = RL_PROMPTS) -> Any:
    """The training dataset of a tiny RL run: ``prompts`` repeated ``repeats`` times (a ``datasets.Dataset``)."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": list(prompts) * repeats})


def zero3_rl_config(cls: type, out: Path, save_16bit: bool = True, **overrides: Any) -> Any:
    """:func:`rl_config` for one rank of a 2-process DeepSpeed ZeRO-3 job on CPUs (run by the DeepSpeed launcher or
    ``accelerate launch --use_deepspeed``): sets up the DeepSpeed state with gloo first and lets the trainer use it.

    Without a GPU, TrainingArguments' own set-up finds no backend for DeepSpeed and sees one process (the state has
    ``num_processes`` 1 while the launcher started 2).

    Args:
        cls (`type`): The config class (``trl.GRPOConfig``).
        out (`Path`): Its ``output_dir``.
        save_16bit (`bool`, *optional*, defaults to `True`): ``stage3_gather_16bit_weights_on_model_save``.
        **overrides: Settings for :func:`rl_config`.

    Returns:
        The config.
    """
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": save_16bit},
        "zero_allow_untested_optimizer": True,
    }
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    state = PartialState(backend="gloo")
    assert state.distributed_type == DistributedType.DEEPSPEED and state.num_processes == 2
    return rl_config(
        cls,
        out,
        use_cpu=False,  # TrainingArguments' default: the DeepSpeed state set up above decides
        deepspeed=ds_config,
        accelerator_config={"use_configured_state": True},
        **overrides,
    )


def train_rl(
    trainer_cls: type,
    base: Path,
    config: Any,
    callback: Any,
    reward: Any,
    dataset: Any,
    peft_config: Any = None,
    resume_from_checkpoint: str | Path | None = None,
) -> Any:
    """Build a TRL RL trainer on the model at ``base`` with ``callback``, bind the callback to it and train.

    Args:
        trainer_cls (`type`): ``trl.GRPOTrainer`` or ``trl.RLOOTrainer``.
        base (`Path`): The model directory.
        config: Its config (:func:`rl_config`).
        callback: A ram_trl callback (bound to the trainer before training).
        reward: The reward function.
        dataset: The prompts (:func:`rl_prompts`).
        peft_config (*optional*): A PEFT config for a LoRA run.
        resume_from_checkpoint (*optional*): A trainer checkpoint to resume from.

    Returns:
        The trained trainer.
    """
    trainer = trainer_cls(
        model=str(base),
        reward_funcs=reward,
        args=config,
        train_dataset=dataset,
        callbacks=[callback],
        peft_config=peft_config,
    )
    callback.bind(trainer)
    trainer.train(resume_from_checkpoint=str(resume_from_checkpoint) if resume_from_checkpoint else None)
    return trainer


# ---------------------------------------------------------------------------------------------------------------
# The telemetry callback's metrics in a finished run: the trainer's log, TensorBoard, ram-trl analyze, the manifest

#: The callback's default metric prefix, spelled out.
TELEMETRY = "task_vector/"


def telemetry_entries(log_history: list[dict]) -> list[dict]:
    """The entries of a trainer's ``log_history`` that carry telemetry."""
    return [e for e in log_history if f"{TELEMETRY}density" in e]


def assert_telemetry_logged(
    log_history: list[dict], measured: dict[str, float], out: Path, steps: list[int]
) -> list[dict]:
    """Check the telemetry a run logged: an entry at each of ``steps`` (the logging steps and the final one), the
    last equal to the tracker's last measurement ``measured``, the core metrics present and consistent, and the
    TensorBoard events in ``out`` carrying every measurement of ``density_saved`` and ``module/attn_q/density``.

    Args:
        log_history (`list[dict]`): The trainer's ``state.log_history``.
        measured (`dict[str, float]`): The tracker's last measurement (``tracker.last``).
        out (`Path`): The trainer's output directory (its TensorBoard event files).
        steps (`list[int]`): The steps at which the callback measured.

    Returns:
        `list[dict]`: The log entries carrying telemetry.
    """
    entries = telemetry_entries(log_history)
    assert [e["step"] for e in entries] == steps
    last = entries[-1]
    assert last == {**last, **measured}
    for key in ("density", "density_exact", "density_saved", "measure_seconds", "magnitude/gini", "layer/1/density"):
        assert f"{TELEMETRY}{key}" in last
    assert 0.0 < last[f"{TELEMETRY}density_saved"] <= last[f"{TELEMETRY}density_exact"] <= 1.0
    assert last[f"{TELEMETRY}measure_seconds"] > 0
    # TensorBoard has every measurement (float32 events)
    for key in ("density_saved", "module/attn_q/density"):
        events = tensorboard_scalars(out, f"{TELEMETRY}{key}")
        assert [s for s, _ in events] == steps
        for (_, value), entry in zip(events, entries, strict=True):
            assert value == pytest.approx(entry[f"{TELEMETRY}{key}"], rel=1e-6)
    return entries


def assert_telemetry_is_the_analysis(measured: dict[str, float], base: Path, agent: Path, kind: str | None = None):
    """Check that a last measurement equals ``ram-trl analyze`` of the saved agent (eps 1e-5) to the element: its
    active elements, density, element count and every module and layer density.

    Args:
        measured (`dict[str, float]`): The last measurement (a log entry or ``tracker.last``).
        base (`Path`): The base checkpoint.
        agent (`Path`): The saved agent (a checkpoint or a PEFT adapter).
        kind (`str`, *optional*): The agent's expected kind (``"full"`` or ``"lora"``); not checked when ``None``.

    Returns:
        `dict`: The analysis result.
    """
    import ram_trl

    result = ram_trl.analyze(base, [agent], eps=1e-5, progress=False, figures=False)
    analysed = result["agents"][0]
    if kind is not None:
        assert analysed["kind"] == kind
    assert measured[f"{TELEMETRY}numel"] == result["total_elements"]
    assert measured[f"{TELEMETRY}active_saved"] == analysed["active"]
    assert measured[f"{TELEMETRY}density_saved"] == analysed["density"]
    for bucket in result["anatomy"]["modules"]:
        assert measured[f"{TELEMETRY}module/{bucket['module']}/density"] == bucket["density"][0]
    for bucket in result["anatomy"]["layers"]:
        assert measured[f"{TELEMETRY}layer/{bucket['layer']}/density"] == bucket["density"][0]
    return result


def assert_stage_manifest(
    agent: Path, base: Path, measured: dict[str, float], log_history: list[dict], kind: str, steps: int
):
    """Check the stage manifest a run left beside its agent: kind, steps, bf16 save, the base's fingerprint (and
    :func:`~ram_trl.stage.manifest.check_base`), the saved density, the last reward metrics and the measured step.

    Args:
        agent (`Path`): The agent directory holding ``ram_stage.json``.
        base (`Path`): The base checkpoint the run started from.
        measured (`dict[str, float]`): The last measurement.
        log_history (`list[dict]`): The trainer's ``state.log_history``.
        kind (`str`): ``"full"`` or ``"lora"``.
        steps (`int`): The run's steps (the last measured one).

    Returns:
        `ram_trl.stage.manifest.StageManifest`: The manifest.
    """
    from ram_trl.callbacks.sparsity import last_reward_metrics
    from ram_trl.stage.manifest import MANIFEST_NAME, check_base, fingerprint_checkpoint, read_manifest

    assert (agent / MANIFEST_NAME).is_file()
    manifest = read_manifest(agent)
    assert manifest.kind == kind and manifest.steps == steps and manifest.save_dtype == "bfloat16"
    assert manifest.base_fingerprint == fingerprint_checkpoint(base)
    check_base(manifest, agent, base)
    assert manifest.telemetry[f"{TELEMETRY}density_saved"] == measured[f"{TELEMETRY}density_saved"]
    assert manifest.rewards == last_reward_metrics(log_history)
    assert manifest.extra["telemetry"]["measured_step"] == steps
    return manifest


def recipe_dict(**changes: Any) -> dict:
    """A minimal valid recipe (one trained stage on the demo's arithmetic task) as a mapping, with ``changes``
    applied by :func:`ram_trl.recipes.schema.apply_overrides` (``stages={"*": {...}}`` changes every stage)."""
    from ram_trl.recipes.schema import apply_overrides

    data = {
        "name": "t",
        "base": {"build": {"hidden_size": 16}},
        "stages": [
            {
                "name": "coding",
                "prompts": {"generator": "ram_trl.recipes.tasks:arithmetic_prompts", "train_size": 4},
                "rewards": ["ram_trl.recipes.tasks:arithmetic_reward"],
                "config": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4},
            }
        ],
    }
    return apply_overrides(data, changes)


def check_recipe(data: dict, **kwargs: Any) -> list[str]:
    """Load a recipe mapping and run the ``--dry-run`` environment checks on it; returns their notes."""
    from ram_trl.recipes.environment import validate_recipe
    from ram_trl.recipes.schema import load_recipe

    parsed, root = load_recipe(data)
    return validate_recipe(parsed, root, **kwargs)


def error_line(capsys, code: int) -> str:
    """The one ``error:`` line of a refused command (exit 2, no traceback)."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    return lines[0]


# ---------------------------------------------------------------------------------------------------------------
# A Hugging Face cache, offline


def offline_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Make ``cache`` the Hugging Face cache (HF_HUB_CACHE, and huggingface_hub's constants, read at its import) and
    set HF_HUB_OFFLINE=1, for one test."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache: Path, repo_id: str, source: Path, commit: str, skip: tuple[str, ...] = ()) -> Path:
    """``source``'s files placed in the cache as huggingface_hub stores them: ``blobs/<sha256>``, the snapshot's files
    links ``../../blobs/<sha256>``, ``refs/main`` the commit. Returns the snapshot directory."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):
        if file.name in skip:
            continue
        sha = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo / "blobs" / sha)
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / sha)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return snapshot


def magnitude_of(values: torch.Tensor, *, zero_filled: bool = False) -> MagnitudeStatistics:
    """One agent's magnitude statistics of some active values (:meth:`MagnitudeStatistics.add_values`)."""
    stats = MagnitudeStatistics(1)
    stats.add_values(0, values, zero_filled=zero_filled)
    return stats


def magnitude_bin(values: torch.Tensor, mantissa_bits: int = 7) -> torch.Tensor:
    """The ``|tau|`` histogram bin of each value, as :class:`MagnitudeStatistics` bins: its float32 bits without the
    sign, keeping ``mantissa_bits`` mantissa bits."""
    bits = values.contiguous().view(torch.int32) & 0x7FFFFFFF
    return bits.bitwise_right_shift_(23 - mantissa_bits)
