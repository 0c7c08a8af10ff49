"""Scoring a model on the stages' held-out prompts with each stage's own rewards (greedy by default, seeded)."""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ram_trl.evaluation.rewards import import_object, wrap_reward
from ram_trl.evaluation.spec import EvaluationSpec

__all__ = [
    "EvalTask",
    "evaluate_loaded",
    "evaluate_model",
    "generate",
    "generation_tokenizer",
    "load_model",
    "score_completions",
]


@dataclass
class EvalTask:
    """One stage's held-out prompts of one split (``"test"`` or ``"val"``) and its reward functions' import paths."""

    stage: str
    rows: list[dict[str, Any]]
    paths: list[str]
    split: str = "test"

    def functions(self) -> list[Any]:
        return [
            wrap_reward(import_object(p, f"stage {self.stage!r}: reward function"), p, self.stage) for p in self.paths
        ]


def load_model(path: str | Path, dtype: str = "float32", base: str | Path | None = None) -> tuple[Any, Any]:
    """A causal LM (or a PEFT adapter merged into its base) in eval mode, left padding for batched generation."""
    from ram_trl.evaluation.fisher import load_agent
    from ram_trl.io.quiet import progress_bars_off

    with progress_bars_off():  # quiet while loading, then as the host had it
        model, tokenizer = load_agent(path, base, getattr(torch, dtype))
    model.eval()
    for name, parameter in model.named_parameters():
        if torch.is_floating_point(parameter) and not bool(torch.isfinite(parameter).all()):
            warnings.warn(
                f"model {path}: parameter {name!r} holds NaN/Inf values; its completions (and scores) are those "
                "of a broken model",
                UserWarning,
                stacklevel=2,
            )
            break
    return model, generation_tokenizer(tokenizer)


def generation_tokenizer(tokenizer: Any) -> Any:
    """``tokenizer`` set up for batched generation: left padding, the EOS token as padding when it has none."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


@torch.no_grad()
def generate(model: Any, tokenizer: Any, prompts: list[str], spec: EvaluationSpec) -> list[str]:
    """Completions of ``prompts`` (new tokens only, special tokens dropped), batched, seeded."""
    completions: list[str] = []
    torch.manual_seed(spec.seed)
    device = next(model.parameters()).device
    for start in range(0, len(prompts), spec.batch_size):
        encoded = tokenizer(
            prompts[start : start + spec.batch_size], return_tensors="pt", padding=True, add_special_tokens=False
        )
        # the model's device, not the tokenizer's host tensors (transformers 5 moves them itself, 4.x does not)
        batch = {key: value.to(device) for key, value in encoded.items()}
        sampling = {"do_sample": True, "temperature": spec.temperature} if spec.do_sample else {"do_sample": False}
        output = model.generate(
            **batch,
            max_new_tokens=spec.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )
        new = output[:, batch["input_ids"].shape[1] :]
        completions.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    return completions


def score_completions(functions: list[Any], rows: list[dict[str, Any]], completions: list[str]) -> list[float]:
    """Per completion, the sum of the reward functions (called TRL-style with the rows' columns)."""
    columns = {key: [row.get(key) for row in rows] for key in rows[0] if key != "prompt"} if rows else {}
    totals = [0.0] * len(completions)
    for fn in functions:
        values = fn(prompts=[r["prompt"] for r in rows], completions=completions, **columns)
        for i, value in enumerate(values):
            totals[i] += float(value) if value is not None else 0.0
    return totals


def evaluate_model(
    path: str | Path,
    tasks: list[EvalTask],
    spec: EvaluationSpec,
    *,
    base: str | Path | None = None,
    samples: int = 3,
    progress: bool = True,
) -> dict[str, Any]:
    """Score one model on every task."""
    start = time.perf_counter()
    model, tokenizer = load_model(path, spec.dtype, base)
    result = evaluate_loaded(model, tokenizer, tasks, spec, name=Path(path).name, samples=samples, progress=progress)
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def evaluate_loaded(
    model: Any,
    tokenizer: Any,
    tasks: list[EvalTask],
    spec: EvaluationSpec,
    *,
    name: str = "model",
    samples: int = 3,
    progress: bool = True,
) -> dict[str, Any]:
    """Score a model already in memory on every task (what :func:`evaluate_model` does after loading)."""
    start = time.perf_counter()
    splits: dict[str, dict[str, Any]] = {}
    for task in tqdm(tasks, desc=f"eval {name}", disable=not progress, leave=False):
        if not task.rows:
            continue
        completions = generate(model, tokenizer, [r["prompt"] for r in task.rows], spec)
        totals = score_completions(task.functions(), task.rows, completions)
        split = splits.setdefault(task.split, {"scores": {}, "n": {}, "rewards": {}, "samples": {}})
        split["scores"][task.stage] = sum(totals) / len(totals)
        split["n"][task.stage] = len(totals)
        split["rewards"][task.stage] = totals
        split["samples"][task.stage] = [
            {"prompt": r["prompt"], "completion": c, "reward": v}
            for r, c, v in list(zip(task.rows, completions, totals, strict=True))[:samples]
        ]
    test = splits.get("test", {"scores": {}, "n": {}, "rewards": {}, "samples": {}})
    result: dict[str, Any] = {**test, "splits": splits, "seconds": round(time.perf_counter() - start, 2)}
    return result
