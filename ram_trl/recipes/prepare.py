"""What a run does before its stages train: rows, ``recipe.yaml``, base, warm start (each skipped when done)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import yaml

from ram_trl.errors import ConfigError
from ram_trl.io.json_files import json_object_or_none
from ram_trl.output import OutputDir, atomic_file
from ram_trl.recipes.data import draw_splits, draw_warm_rows, read_jsonl, split_check_rows, write_jsonl
from ram_trl.recipes.layout import RunLayout, resolve_path

__all__ = ["RunPreparation"]


class RunPreparation:
    """The base, the warm start and the prompt files of a run (a part of :class:`~ram_trl.recipes.runner.Run`)."""

    def __init__(self, layout: RunLayout) -> None:
        self.layout = layout

    def draw(self) -> dict[str, tuple[list[dict[str, Any]], ...]]:
        """Every stage's rows (train, test, val, warm, check), validated, each reward called once on them."""
        from ram_trl.recipes.stage import preflight_rewards

        drawn = {}
        spec = self.layout.recipe.warm_start
        for stage in self.layout.recipe.stages:
            train, held, val = draw_splits(stage, self.layout.root)
            preflight_rewards(stage, train or held or val)
            warm = draw_warm_rows(stage, held + val) if spec is not None else None
            check = None
            if warm is not None and spec.accept is not None and stage.rewards:
                warm, check = split_check_rows(warm, train, spec.accept.check_size)
            drawn[stage.name] = (train, held, val, warm, check)
        if spec is not None and spec.accept is not None and not any(d[4] for d in drawn.values()):
            raise ConfigError(
                "warm_start.accept measures its criterion on rows held out of the warm-start rows, and no stage draws "
                "any: give the stages prompts.warm_size (or remove warm_start.accept)"
            )
        return drawn

    def prepare(self, recipe_file: Path | None = None) -> None:
        """Check the run directory, draw and write the rows and ``recipe.yaml``, build the base, warm-start it."""
        self.layout.check_dir(recipe_file)
        start = time.perf_counter()
        drawn = self.draw()
        self.layout.dir.mkdir(parents=True, exist_ok=True)
        text = yaml.safe_dump(self.layout.resolved_recipe(), sort_keys=False)
        with atomic_file(self.layout.dir / "recipe.yaml", "run recipe") as tmp:
            tmp.write_text(text, encoding="utf-8")
        for stage in self.layout.recipe.stages:
            train, held, val, warm, check = drawn[stage.name]
            write_jsonl(train, self.layout.dir / "data" / stage.name / "train.jsonl")
            write_jsonl(held, self.layout.dir / "data" / stage.name / "eval.jsonl")
            write_jsonl(val, self.layout.dir / "data" / stage.name / "val.jsonl")
            if warm is not None:
                write_jsonl(warm, self.layout.dir / "data" / stage.name / "warm.jsonl")
            if check:
                write_jsonl(check, self.layout.dir / "data" / stage.name / "check.jsonl")
            else:
                (self.layout.dir / "data" / stage.name / "check.jsonl").unlink(missing_ok=True)
        self.layout.timed("data", start)
        if self.layout.recipe.base.build is not None:
            self.build_base()
        if self.layout.recipe.base.gguf is not None:
            self.convert_base()
        if self.layout.recipe.warm_start is not None:
            self.warm_start()

    def build_base(self) -> None:
        """Build ``base.build`` into ``RUN/base_init`` unless an identical build is there."""
        from ram_trl.synthetic import make_base_checkpoint

        target = self.layout.dir / "base_init"
        record = target / "ram_build.json"
        spec = yaml.safe_dump(self.layout.recipe.base.build, sort_keys=True)
        if record.is_file() and record.read_text(encoding="utf-8") == spec:
            return
        start = time.perf_counter()
        import torch

        build = dict(self.layout.recipe.base.build)
        if isinstance(build.get("dtype"), str):
            build["dtype"] = getattr(torch, build["dtype"])
        output = OutputDir(target, markers=("ram_build.json",), replace_previous=True, what="base model directory")
        with output as tmp:
            make_base_checkpoint(tmp, **build)
            (tmp / "ram_build.json").write_text(spec, encoding="utf-8")
        self.layout.timed("build_base", start)
        self.layout.console.print(f"[green]built[/] base model {target}")

    def convert_base(self) -> None:
        """Convert ``base.gguf`` into ``RUN/base_init`` unless the same bytes in the same dtype were converted."""
        from ram_trl.io.gguf import RECORD_NAME, convert_gguf, open_gguf_source

        spec = self.layout.recipe.base
        target = self.layout.dir / "base_init"
        source = open_gguf_source(resolve_path(spec.gguf, self.layout.root), spec.gguf_member)
        done = json_object_or_none(target / RECORD_NAME)
        if done and done.get("sha256") == source.digest() and done.get("dtype") == spec.gguf_dtype:
            return
        start = time.perf_counter()
        self.layout.console.print(f"converting the GGUF base {source.label} ...")
        result = convert_gguf(source.path, target, member=source.member, dtype=spec.gguf_dtype, replace_previous=True)
        self.layout.timed("convert_base", start)
        self.layout.console.print(
            f"[green]converted[/] {result['gguf_file']} -> {target} ({result['parameters']:,} parameters, "
            f"{result['dtype']}; logits identical to the GGUF model's in {result['dtype']})"
        )

    def warm_start(self) -> None:
        """Warm-start the base into ``RUN/base`` unless an identical warm start is there."""
        from ram_trl.recipes.warm_start import WARM_START_RECORD, acceptance_line, criterion, warm_start

        spec = self.layout.recipe.warm_start
        source = self.layout.initial_base
        if spec.abstain_share:
            spec = spec.model_copy(update={"abstain_reply": self.abstain_reply(spec.abstain_reply)})
        done = json_object_or_none(self.layout.base / WARM_START_RECORD)  # unreadable: warm-start again
        if done and done.get("spec") == spec.model_dump() and done.get("rows_digest") == self._rows_digest():
            return
        from ram_trl.recipes.tasks import mixture

        rows = mixture([read_jsonl(file) for file in self._warm_files()], seed=spec.seed)
        digest = self._rows_digest()
        start = time.perf_counter()
        steps = f"{spec.steps} + {spec.abstain_steps} abstaining" if spec.abstain_share else str(spec.steps)
        if spec.accept is not None:
            steps = f"until {criterion(spec)}: at least {spec.steps}"
        self.layout.console.print(f"warm start: {steps} steps on {len(rows)} rows ...")
        result = warm_start(
            source,
            self.layout.base,
            rows,
            spec,
            progress=self.layout.options.progress,
            record_extra={"rows_digest": digest},
            checks=self.layout.check_tasks() if spec.accept is not None else None,
            on_check=self._report_check,
            write=self.layout.say,
        )
        self.layout.timed("warm_start", start)
        self.layout.console.print(
            f"[green]warm start[/] {result['steps']} steps: loss {result['loss_first']:.3f} -> "
            f"{result['loss_last']:.3f} ({result['seconds']:.0f}s)"
        )
        if "acceptance" in result:
            self.layout.console.print(acceptance_line(result))

    def _report_check(self, phase: str, step: int, values: dict[str, float]) -> None:
        what = "sampled pass@k" if phase == "answers" else "greedy declines"
        shown = ", ".join(f"{stage} {value:.2f}" for stage, value in values.items())
        self.layout.console.print(f"warm start ({phase}) step {step}: {what} {shown}")

    def abstain_reply(self, reply: str | None) -> str:
        """``reply``, or the first of :data:`ABSTAIN_REPLIES` that earns no reward on any stage's test or val rows."""
        from ram_trl.evaluation.scoring import score_completions
        from ram_trl.recipes.schema import ABSTAIN_REPLIES

        def earning(candidate: str) -> tuple[str, str, float] | None:
            for task in self.layout.eval_tasks():
                earned = score_completions(task.functions(), task.rows, [candidate] * len(task.rows))
                if any(value > 0 for value in earned):
                    return task.stage, task.split, sum(earned) / len(earned)
            return None

        for candidate in ABSTAIN_REPLIES if reply is None else (reply,):
            found = earning(candidate)
            if found is None:
                return candidate
            if reply is not None:
                stage, split, mean = found
                raise ConfigError(
                    f"recipe {self.layout.recipe.name!r}: warm_start.abstain_reply {reply!r} earns a reward on stage "
                    f"{stage!r} ({split} mean {mean:.3f}): choose a reply that no stage rewards (an abstention must "
                    "score 0)"
                )
        raise ConfigError(
            f"recipe {self.layout.recipe.name!r}: every default warm_start.abstain_reply {list(ABSTAIN_REPLIES)} earns a "
            "reward on some stage: set warm_start.abstain_reply to a reply that no stage rewards"
        )

    def warm_start_record(self) -> dict[str, Any] | None:
        """The warm start's record (``RUN/base/ram_warm_start.json``) when it measured an acceptance criterion."""
        import json

        from ram_trl.recipes.warm_start import WARM_START_RECORD

        path = self.layout.base / WARM_START_RECORD
        if self.layout.recipe.warm_start is None or self.layout.recipe.warm_start.accept is None or not path.is_file():
            return None
        record = json.loads(path.read_text(encoding="utf-8"))
        if "acceptance" not in record:
            return None
        return {"steps": record["steps"], **record["acceptance"]}

    def _warm_files(self) -> list[Path]:
        """Every stage's ``warm.jsonl``, or the trained stages' training rows when no stage draws warm rows."""
        warm = [self.layout.dir / "data" / s.name / "warm.jsonl" for s in self.layout.recipe.stages]
        if any(f.is_file() and f.stat().st_size for f in warm):
            return [f for f in warm if f.is_file()]
        return [self.layout.dir / "data" / s.name / "train.jsonl" for s in self.layout.recipe.stages if s.trained]

    def _rows_digest(self) -> str:
        from ram_trl.digest import hasher

        digest = hasher()
        for file in self._warm_files():
            digest.update(file.read_bytes())
        for stage in self.layout.recipe.stages:
            check = self.layout.dir / "data" / stage.name / "check.jsonl"
            if check.is_file():
                digest.update(check.read_bytes())
        return digest.hexdigest()
