"""A run's long steps as a bar with an ETA, or log lines; stage processes report via :func:`step_lines`."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

__all__ = ["STEP_MARK", "Progress", "duration", "parse_step", "step_lines"]

STEP_MARK = "ram-trl progress:"  #: Printed by a stage process before its step count (read by the launcher).
_STEP = re.compile(re.escape(STEP_MARK) + r" step (\d+)/(\d+)\s*$")


def duration(seconds: float) -> str:
    """``"42s"``, ``"3m05s"``, ``"1h02m"``."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def parse_step(line: str) -> tuple[int, int] | None:
    """``(step, total)`` of a :data:`STEP_MARK` line, else ``None``."""
    match = _STEP.search(line.strip())
    return (int(match.group(1)), int(match.group(2))) if match else None


def step_lines(interval: float = 2.0) -> Any:
    """A trainer callback printing :data:`STEP_MARK` lines (main process; first, last, every ``interval`` s)."""
    from transformers import TrainerCallback

    class StepLines(TrainerCallback):
        last = float("-inf")

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            now = time.monotonic()
            final = state.global_step >= state.max_steps
            if state.is_world_process_zero and (final or now - self.last >= interval):
                self.last = now
                print(f"{STEP_MARK} step {state.global_step}/{state.max_steps}", flush=True)

    return StepLines()


class Progress:
    """``done`` of ``total`` with an ETA: a tqdm bar, or lines through ``write``; ``first`` items were done before."""

    def __init__(
        self,
        label: str,
        total: int,
        bar: bool,
        write: Callable[[str], None],
        every_item: bool = True,
        first: int = 0,
        every: int | None = None,
    ) -> None:
        self.label, self.total, self.write, self.every_item = label, max(total, 0), write, every_item
        self.first, self.every = first, every
        self.start, self.done, self.mark = time.perf_counter(), first, 0
        self.bar = None
        if bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total, initial=first, desc=label, leave=False)

    def update(self, done: int, item: str | None = None) -> None:
        """``done`` items (or steps) finished so far; ``item``: the one just finished."""
        step, self.done = done - self.done, done
        if self.bar is not None:
            if item:
                self.bar.set_postfix_str(item, refresh=False)
            self.bar.update(step)
            return
        counted, span = done - self.first, self.total - self.first
        tenths = 10 * counted // span if span > 0 else 10
        mark = counted // self.every if self.every else tenths
        if not self.every_item and mark <= self.mark and done < self.total:
            return
        self.mark = mark
        elapsed = time.perf_counter() - self.start
        left = elapsed * (self.total - done) / counted if counted > 0 else None
        when = f"{duration(elapsed)}" + (f"; about {duration(left)} left" if left and done < self.total else "")
        self.write(f"{self.label} {done}/{self.total}" + (f": {item}" if item else "") + f" ({when})")

    def close(self) -> None:
        """Remove the bar (a log file keeps its lines)."""
        if self.bar is not None:
            self.bar.close()
