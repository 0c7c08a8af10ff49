"""Supervised warm start of a tiny base on (prompt, answer) rows with TRL's ``SFTTrainer``, until accepted."""

from __future__ import annotations

import json
import logging
import math
import random
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from ram_trl.errors import ConfigError
from ram_trl.output import OutputDir, guard_os_errors
from ram_trl.recipes.progress import Progress
from ram_trl.recipes.schema import WarmStartSpec

__all__ = [
    "WARM_START_RECORD",
    "AcceptanceCallback",
    "acceptance_line",
    "acceptance_summary",
    "criterion",
    "decline_target",
    "encode_rows",
    "pass_at_k",
    "phase_met",
    "warm_start",
    "with_abstentions",
]

logger = logging.getLogger(__name__)

WARM_START_RECORD = "ram_warm_start.json"  #: In the warm-started base; its presence marks the warm start complete.


def encode_rows(tokenizer: Any, rows: list[dict[str, Any]]) -> list[tuple[list[int], list[int]]]:
    """Token ids and labels of each row: ``prompt + answer + eos``, labels ``-100`` on the prompt."""
    encoded = []
    for index, row in enumerate(rows):
        if not isinstance(row.get("answer"), str):
            raise ConfigError(f"warm start: row {index} ({row.get('prompt')!r}) has no string 'answer' to train on")
        prompt = tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
        answer = tokenizer(row["answer"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        encoded.append((prompt + answer, [-100] * len(prompt) + answer))
    return encoded


def with_abstentions(rows: list[dict[str, Any]], share: float, reply: str, seed: int) -> list[dict[str, Any]]:
    """``rows`` with a seeded ``share`` of answers replaced by ``reply`` (each row independently)."""
    rng = random.Random(f"abstain-{seed}")
    return [dict(row, answer=reply) if rng.random() < share else row for row in rows]


@contextmanager
def _own_random_state() -> Iterator[None]:
    """The process's random states (Python, NumPy, torch) as they were on entry: the trainer seeds them globally."""
    python, numpy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(python)
        np.random.set_state(numpy)


class _Steps(TrainerCallback):
    """Every step's loss, and the steps to the next check as a bar or as lines through ``write``."""

    def __init__(
        self,
        label: str,
        max_steps: int,
        acceptance: AcceptanceCallback | None,
        progress: bool,
        write: Callable[[str], None],
    ) -> None:
        self.label, self.max_steps, self.acceptance = label, max_steps, acceptance
        self.progress, self.write = progress, write
        first = max_steps if acceptance is None else acceptance.next_check
        self.every, self.shown, self.losses = max(1, first // 10), None, []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.shown is None or state.global_step >= self.shown.total:
            if self.shown is not None:
                self.shown.close()
            end = self.max_steps if self.acceptance is None else self.acceptance.next_check
            self.shown = Progress(
                self.label,
                end,
                bar=self.progress,
                write=self.write,
                every_item=False,
                first=state.global_step,
                every=self.every,
            )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.shown.update(state.global_step)

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kwargs: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            if self.shown is not None and self.shown.bar is not None:
                self.shown.bar.set_postfix(loss=f"{self.losses[-1]:.3f}")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.shown is not None:
            self.shown.close()


def _draws(rng: random.Random, rows: int, size: int, steps: int) -> list[int]:
    """Row indices of ``steps`` batches of ``size`` distinct rows, each batch drawn independently from ``rng``."""
    return [index for _ in range(steps) for index in rng.sample(range(rows), size)]


def _train_phase(
    model: Any,
    tokenizer: Any,
    encoded: list[tuple[list[int], list[int]]],
    *,
    steps: int,
    max_steps: int,
    learning_rate: float,
    spec: WarmStartSpec,
    rng: random.Random,
    label: str,
    progress: bool,
    write: Callable[[str], None],
    acceptance: AcceptanceCallback | None = None,
) -> list[float]:
    """``SFTTrainer`` for ``max_steps`` (fewer when ``acceptance`` stops it) on the CPU; every step's loss."""
    from datasets import Dataset
    from transformers import PrinterCallback, ProgressCallback
    from trl import SFTConfig, SFTTrainer

    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate, weight_decay=spec.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(step, steps) / steps))
    )
    # The hand-written loop this replaced, step for step (20 demo steps: losses 4.6705 -> 3.2644 in both, 14.4 s of
    # CPU vs 15.8 s): each batch drawn on its own from ``rng`` and read in order. With an epoch shuffle instead, the
    # demo needed 1,300 steps to pass phase one's check, against 600.
    size, drawn = min(spec.batch_size, len(encoded)), rng.getstate()
    data = Dataset.from_dict({"input_ids": [ids for ids, _ in encoded], "labels": [lab for _, lab in encoded]}).select(
        _draws(rng, len(encoded), size, max_steps)
    )
    recorder = _Steps(label, max_steps, acceptance, progress, write)
    with tempfile.TemporaryDirectory(prefix="ram-warm-start-") as scratch, _own_random_state():
        config = SFTConfig(
            output_dir=scratch,
            max_steps=max_steps,
            per_device_train_batch_size=size,
            train_sampling_strategy="sequential",  # the batches as drawn above
            max_grad_norm=1.0,
            seed=spec.seed,
            bf16=False,  # TRL's defaults: bf16 autocast and activation checkpointing; the warm start trains float32
            activation_checkpointing=False,
            max_length=None,
            logging_steps=1,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            use_cache=model.config.use_cache,  # the trainer writes it into the model's config (then saved)
            dataloader_pin_memory=False,
        )
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tokenizer,
            optimizers=(optimizer, schedule),
            callbacks=[recorder] + ([acceptance] if acceptance is not None else []),
        )
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
        trainer.train()
    rng.setstate(drawn)
    _draws(rng, len(encoded), size, trainer.state.global_step)
    return recorder.losses


def pass_at_k(passed: list[list[bool]]) -> float:
    """Share of rows with at least one passing sample (the empirical pass@k of ``k`` samples per row)."""
    return sum(any(row) for row in passed) / len(passed) if passed else 0.0


def phase_met(measured: dict[str, float], target: float, how: str = "every") -> bool:
    """Whether every stage's measurement (``how="every"``) or their mean (``"mean"``) reaches ``target``."""
    if not measured:
        return False
    if how == "mean":
        return sum(measured.values()) / len(measured) >= target
    return all(value >= target for value in measured.values())


class AcceptanceCallback(TrainerCallback):
    """Stops training at the first check where ``met(measure())``: after ``first``, every ``every``, up to ``cap``."""

    def __init__(
        self,
        measure: Callable[[], dict[str, float]],
        met: Callable[[dict[str, float]], bool],
        *,
        first: int,
        every: int,
        cap: int,
        on_check: Callable[[int, dict[str, float]], None] | None = None,
    ) -> None:
        self.measure, self.met, self.every, self.cap, self.on_check = measure, met, every, cap, on_check
        self.next_check = min(first, cap)
        self.checks: list[dict[str, Any]] = []
        self.accepted = False

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        step = state.global_step
        if step < self.next_check:
            return
        values = self.measure()
        self.checks.append({"step": step, "values": values})
        if self.on_check is not None:
            self.on_check(step, values)
        self.accepted = self.met(values)
        if self.accepted or step >= self.cap:
            control.should_training_stop = True
        self.next_check = min(step + self.every, self.cap)

    def record(self) -> dict[str, Any]:
        """The phase's steps, cap, whether the criterion was met and every check."""
        steps = self.checks[-1]["step"] if self.checks else 0
        return {"steps": steps, "cap": self.cap, "met": self.accepted, "checks": self.checks}


class _Checker:
    """Acceptance measurements on a copy rounded to the saved dtype, in eval mode, under a forked random state.
    The copy is made before training: a copy of the trained model keeps TRL's patched ``forward``."""

    def __init__(
        self,
        base_in: Path,
        model: Any,
        checks: list[Any],
        spec: WarmStartSpec,
        progress: bool,
        write: Callable[[str], None],
    ) -> None:
        import copy

        from transformers import AutoTokenizer

        from ram_trl.evaluation.scoring import generation_tokenizer

        self.tokenizer = generation_tokenizer(AutoTokenizer.from_pretrained(str(base_in)))
        self.checks, self.spec, self.accept, self.progress = checks, spec, spec.accept, progress
        self.write = write
        self.saved = copy.deepcopy(model).eval()

    def _tasks(self, what: str) -> Iterator[Any]:
        """The check tasks, with a bar or a line each (a check can take minutes on a busy CPU)."""
        shown = Progress(f"warm start check ({what})", len(self.checks), bar=self.progress, write=self.write)
        for done, task in enumerate(self.checks, 1):
            yield task
            shown.update(done, task.stage)
        shown.close()

    def _copy(self, model: Any) -> Any:
        self.saved.load_state_dict(model.state_dict())
        return self.saved.to(getattr(torch, self.spec.save_dtype)).to(torch.float32)

    def _generate(self, model: Any, prompts: list[str], sample: bool) -> list[str]:
        from ram_trl.evaluation.scoring import generate
        from ram_trl.recipes.schema import EvaluationSpec

        decoding = EvaluationSpec(
            do_sample=sample,
            temperature=self.accept.temperature,
            max_new_tokens=self.accept.max_new_tokens,
            seed=self.accept.seed,
            batch_size=256,
        )
        with torch.random.fork_rng(devices=[]):
            return generate(model, self.tokenizer, prompts, decoding)

    def pass_rates(self, model: Any) -> dict[str, float]:
        """Per stage, the sampled pass@k on its check rows."""
        from ram_trl.evaluation.scoring import score_completions

        copy, k, out = self._copy(model), self.accept.pass_k, {}
        for task in self._tasks("answers"):
            rows = [row for row in task.rows for _ in range(k)]
            scores = score_completions(task.functions(), rows, self._generate(copy, [r["prompt"] for r in rows], True))
            passed = [score >= self.accept.pass_reward for score in scores]
            out[task.stage] = round(pass_at_k([passed[i : i + k] for i in range(0, len(passed), k)]), 4)
        return out

    def declines(self, model: Any) -> dict[str, float]:
        """Per stage, the share of check rows on which greedy decoding answers ``abstain_reply``."""
        from ram_trl.recipes.tasks import completion_text

        copy, out = self._copy(model), {}
        for task in self._tasks("declines"):
            completions = self._generate(copy, [r["prompt"] for r in task.rows], False)
            declined = [completion_text(c) == self.spec.abstain_reply for c in completions]
            out[task.stage] = round(sum(declined) / len(declined), 4)
        return out


def criterion(spec: WarmStartSpec) -> str:
    """The acceptance criterion of ``spec`` in words (for ``ram_warm_start.json`` and results.md)."""
    accept = spec.accept
    text = (
        f"every stage's sampled pass@{accept.pass_k} (temperature {accept.temperature:g}, summed reward >= "
        f"{accept.pass_reward:g}) on its {accept.check_size} check rows >= {accept.min_pass:g}, checked after "
        f"{spec.steps} steps and every {accept.every} after, cap {accept.max_steps}"
    )
    if spec.abstain_share:
        text += (
            f"; then greedy declines on >= {decline_target(spec):g} of the check rows (mean over stages), checked after "
            f"{spec.abstain_steps} steps and every {accept.abstain_every} after, cap {accept.abstain_max_steps}"
        )
    return text


def decline_target(spec: WarmStartSpec) -> float:
    """Phase two's target: the greedy decline share, mean over stages, at which it stops."""
    return round(max(0.0, spec.abstain_share - spec.accept.decline_tolerance), 6)


def _values(values: dict[str, float]) -> str:
    return ", ".join(f"{stage} {value:.2f}" for stage, value in values.items())


def acceptance_summary(acceptance: dict[str, Any]) -> list[str]:
    """The acceptance record in words; a phase that hit its cap unmet is marked ``WARNING``."""
    names = {"answers": "phase one (answers): sampled pass@k", "abstain": "phase two (abstentions): greedy declines"}
    lines = []
    for name, phase in acceptance["phases"].items():
        last = phase["checks"][-1]["values"]
        if phase["met"]:
            lines.append(f"{names[name]} met after {phase['steps']} steps (cap {phase['cap']}): {_values(last)}")
        else:
            lines.append(
                f"WARNING: {names[name]} NOT met: the cap of {phase['cap']} steps was hit ({_values(last)}); "
                "the specialists may not learn"
            )
    final = acceptance["final"]
    text = f"saved base: sampled pass@k {_values(final['pass_at_k'])}"
    if "decline" in final:
        text += f"; greedy declines {_values(final['decline'])}"
    return [*lines, text]


def acceptance_line(record: dict[str, Any]) -> str:
    """The terminal's summary of a warm start's acceptance (rich markup: red when a cap was hit)."""
    acceptance = record["acceptance"]
    colour = "green" if acceptance["accepted"] else "bold red"
    verdict = "accepted" if acceptance["accepted"] else "NOT ACCEPTED"
    return f"[{colour}]warm start {verdict}[/]: " + "; ".join(acceptance_summary(acceptance))


def warm_start(
    base_in: str | Path,
    base_out: str | Path,
    rows: list[dict[str, Any]],
    spec: WarmStartSpec,
    progress: bool = True,
    record_extra: dict[str, Any] | None = None,
    checks: list[Any] | None = None,
    on_check: Callable[[str, int, dict[str, float]], None] | None = None,
    write: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train ``base_in`` on ``rows`` in float32 and save it to ``base_out`` (replacing only a previous warm start);
    then a phase with ``spec.abstain_share`` abstaining; each runs until ``spec.accept`` holds or its cap."""
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
    if spec.abstain_share and spec.abstain_reply is None:
        raise ConfigError("warm start: abstain_share needs an abstain_reply (the runner chooses one)")
    accept = spec.accept
    if accept is not None and not checks:
        raise ConfigError("warm start: warm_start.accept needs check rows (none were given)")
    write = write or (lambda line: None)
    checker = _Checker(base_in, model, checks, spec, progress, write) if accept is not None else None
    acceptance: dict[str, Any] = {}
    rng = random.Random(spec.seed)  # the batches of both phases

    def phase(name: str, data: list[tuple[list[int], list[int]]], steps: int, lr: float) -> list[float]:
        callback = None
        if checker is not None:
            answers = name == "answers"
            callback = AcceptanceCallback(
                (lambda: checker.pass_rates(model)) if answers else (lambda: checker.declines(model)),
                (lambda v: phase_met(v, accept.min_pass))
                if answers
                else (lambda v: phase_met(v, decline_target(spec), how="mean")),
                first=steps,
                every=accept.every if answers else accept.abstain_every,
                cap=accept.max_steps if answers else accept.abstain_max_steps,
                on_check=(lambda step, values: on_check(name, step, values)) if on_check else None,
            )
            acceptance[name] = callback
        return _train_phase(
            model,
            tokenizer,
            data,
            steps=steps,
            max_steps=steps if callback is None else callback.cap,
            learning_rate=lr,
            spec=spec,
            rng=rng,
            label=f"warm start ({name}): step",
            progress=progress,
            write=write,
            acceptance=callback,
        )

    losses = phase("answers", encoded, spec.steps, spec.learning_rate)
    if spec.abstain_share:
        mixed = with_abstentions(rows, spec.abstain_share, spec.abstain_reply, spec.seed)
        abstaining = sum(row["answer"] == spec.abstain_reply for row in mixed)
        losses += phase("abstain", encode_rows(tokenizer, mixed), spec.abstain_steps, spec.abstain_learning_rate)
    acceptance = {name: callback.record() for name, callback in acceptance.items()}
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
    if checker is not None:
        final = {"pass_at_k": checker.pass_rates(model)}
        if spec.abstain_share:
            final["decline"] = checker.declines(model)
        record["acceptance"] = {
            "criterion": criterion(spec),
            "accepted": all(phase["met"] for phase in acceptance.values()),
            "phases": acceptance,
            "final": final,
            "check_rows": {task.stage: len(task.rows) for task in checks},
        }
        record["seconds"] = round(time.perf_counter() - start, 2)
        for name, phase in acceptance.items():
            if not phase["met"]:
                message = (
                    f"warm start: phase {name!r} hit its cap of {phase['cap']} steps without meeting the acceptance "
                    f"criterion (last check: {phase['checks'][-1]['values']}; criterion: {criterion(spec)}); the "
                    "specialists may not learn: raise the cap or the learning rate"
                )
                warnings.warn(message, stacklevel=2)
                logger.warning(message)
    with output as tmp, guard_os_errors(f"warm-started base directory {base_out}"):
        model.to(getattr(torch, spec.save_dtype)).save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        if (base_in / "generation_config.json").is_file():
            GenerationConfig.from_pretrained(str(base_in)).save_pretrained(str(tmp))
        (tmp / WARM_START_RECORD).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    return record
