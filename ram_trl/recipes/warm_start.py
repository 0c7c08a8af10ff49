"""Supervised warm start: a few hundred steps of next-token training on (prompt, answer) rows, so a freshly built
tiny base produces answers of the right shape and RL rewards are not all zero."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ram_trl.errors import ConfigError
from ram_trl.output import OutputDir, guard_os_errors
from ram_trl.recipes.schema import WarmStartSpec

__all__ = ["WARM_START_RECORD", "encode_rows", "warm_start", "with_abstentions"]

#: Written into the warm-started base; its presence marks the warm start as complete (for ``--resume``).
WARM_START_RECORD = "ram_warm_start.json"


def encode_rows(tokenizer: Any, rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels of each row: ``prompt + answer + eos``, labels ``-100`` on the prompt.

    Args:
        tokenizer: The base's tokenizer (no special tokens added; its ``eos_token_id`` ends each answer).
        rows: Warm-start rows (``prompt``, ``answer``).

    Returns:
        Per row, its token ids and its labels.

    Raises:
        ConfigError: when a row has no string ``answer``.
    """
    encoded = []
    for index, row in enumerate(rows):
        if not isinstance(row.get("answer"), str):
            raise ConfigError(
                f"warm start: row {index} ({row.get('prompt')!r}) has no string 'answer' to train on"
            )
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt + answer, [-100] * len(prompt) + answer))
    return encoded


def with_abstentions(rows: list[dict[str, Any]], share: float, reply: str, seed: int) -> list[dict[str, Any]]:
    """``rows`` with the answer of a seeded ``share`` of them replaced by ``reply`` (each row independently, so
    every task abstains at about the same rate).

    Args:
        rows: Warm-start rows (``prompt``, ``answer``).
        share: Probability that a row abstains, in ``[0, 1)``.
        reply: The abstaining answer.
        seed: Seed of the draw.

    Returns:
        New rows (the input rows are not modified).
    """
    rng = random.Random(f"abstain-{seed}")
    return [dict(row, answer=reply) if rng.random() < share else row for row in rows]


def _batch(items: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in items)
    input_ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    labels = torch.full((len(items), width), -100, dtype=torch.long)
    mask = torch.zeros((len(items), width), dtype=torch.long)
    for i, (ids, lab) in enumerate(items):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(ids)] = 1
    return {"input_ids": input_ids, "labels": labels, "attention_mask": mask}


def _train(
    model: Any,
    encoded: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    learning_rate: float,
    spec: WarmStartSpec,
    rng: random.Random,
    pad_id: int,
    progress: bool,
) -> list[float]:
    """``steps`` AdamW steps on batches drawn from ``encoded`` (cosine decay to 10% of ``learning_rate``); the
    losses."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=spec.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
    )
    losses: list[float] = []
    bar = tqdm(range(steps), desc="warm start", disable=not progress, leave=False)
    for _ in bar:
        batch = _batch(rng.sample(encoded, min(spec.batch_size, len(encoded))), pad_id)
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.detach().item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    return losses


def warm_start(
    base_in: str | Path,
    base_out: str | Path,
    rows: list[dict[str, Any]],
    spec: WarmStartSpec,
    progress: bool = True,
    record_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``base_in`` on ``rows`` (float32, AdamW, cosine decay to 10%) and save it to ``base_out``.

    With ``spec.abstain_share``, a second phase of ``spec.abstain_steps`` steps follows on the same rows with that
    share abstaining (:func:`with_abstentions`): the tasks are learned first, the habit of declining on top, so
    the abstentions do not slow the learning of the tasks.

    The output (model in ``spec.save_dtype``, tokenizer, generation config, :data:`WARM_START_RECORD`) goes through
    the output-commit protocol (:class:`~ram_trl.output.OutputDir`): written to a temporary sibling and renamed into
    place, replacing a previous warm start (a directory holding :data:`WARM_START_RECORD`) and nothing else.

    Args:
        base_in: The checkpoint to train.
        base_out: The warm-started checkpoint's directory.
        rows: ``prompt`` / ``answer`` rows.
        spec: The recipe's ``warm_start`` section.
        progress: Show a progress bar.
        record_extra: More fields of the record (the runner's digest of the rows).

    Returns:
        The record: steps, first and last losses, seconds.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    base_in, base_out = Path(base_in), Path(base_out)
    output = OutputDir(
        base_out,
        markers=(WARM_START_RECORD,),
        replace_previous=True,
        reads=[("base model", base_in)],
        what="warm-started base directory",
    )
    output.check()
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(str(base_in))
    model = AutoModelForCausalLM.from_pretrained(str(base_in), dtype=torch.float32)
    model.train()
    encoded = encode_rows(tokenizer, rows)
    if not encoded:
        raise ConfigError("warm start: no rows to train on")
    abstaining = 0
    rng = random.Random(spec.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        losses = _train(
            model,
            encoded,
            steps=spec.steps,
            learning_rate=spec.learning_rate,
            spec=spec,
            rng=rng,
            pad_id=tokenizer.pad_token_id,
            progress=progress,
        )
        if spec.abstain_share:
            if spec.abstain_reply is None:
                raise ConfigError("warm start: abstain_share needs an abstain_reply (the runner chooses one)")
            mixed = with_abstentions(rows, spec.abstain_share, spec.abstain_reply, spec.seed)
            abstaining = sum(row["answer"] == spec.abstain_reply for row in mixed)
            losses += _train(
                model,
                encode_rows(tokenizer, mixed),
                steps=spec.abstain_steps,
                learning_rate=spec.abstain_learning_rate,
                spec=spec,
                rng=rng,
                pad_id=tokenizer.pad_token_id,
                progress=progress,
            )
    record = {
        "steps": len(losses),
        "loss_first": losses[0],
        "loss_last": sum(losses[-10:]) / len(losses[-10:]),
        "rows": len(encoded),
        "abstaining_rows": abstaining,
        "spec": spec.model_dump(),
        "base": str(base_in),
        "seconds": round(time.perf_counter() - start, 2),
        **(record_extra or {}),
    }
    with output as tmp, guard_os_errors(f"warm-started base directory {base_out}"):
        model.to(getattr(torch, spec.save_dtype)).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if (base_in / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(str(base_in)).save_pretrained(str(tmp))
        (tmp / WARM_START_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
