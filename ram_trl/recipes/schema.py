"""The recipe file (YAML): a base model, stages (one RL run per vertical), merges, evaluation (docs/recipes.md)."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from ram_trl import defaults
from ram_trl.errors import ConfigError
from ram_trl.evaluation.spec import MAX_SEED, EvaluationSpec, FloatDtype, StrictModel
from ram_trl.messages import validation_message

__all__ = [
    "RESERVED_NAMES",
    "check_row_names",
    "ABSTAIN_REPLIES",
    "DEFAULT_METHODS",
    "BaseSpec",
    "EvaluationSpec",
    "MergeRow",
    "MergeSpec",
    "PreviewSpec",
    "PromptSpec",
    "Recipe",
    "StageSpec",
    "WarmStartAcceptance",
    "WarmStartSpec",
    "apply_overrides",
    "expand_merges",
    "load_recipe",
]

#: Merge methods compared when a recipe gives no ``merges``.
DEFAULT_METHODS: tuple[str, ...] = ("ram", "ram_plus", "task_arithmetic", "ties", "dare_linear", "dare_ties")

#: Keyword arguments of :func:`ram_trl.evaluation.fisher.estimate_fisher` a ``fisher`` merge entry may set.
FISHER_SETTINGS = frozenset({"num_samples", "max_new_tokens", "sample", "seed"})

_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"


_Strict = StrictModel  #: The recipe's models refuse unknown keys, NaN/Inf and booleans given for numbers.


class BaseSpec(_Strict):
    """The base model: a checkpoint (``path``), a GGUF file (``gguf``) or a tiny Qwen2 built from a config."""

    path: str | None = None
    hub_id: str | None = None
    build: dict[str, Any] | None = None
    gguf: str | None = None
    gguf_member: str | None = None
    gguf_dtype: FloatDtype = "bfloat16"

    @model_validator(mode="after")
    def _one_source(self) -> BaseSpec:
        if sum(x is not None for x in (self.path, self.build, self.gguf)) != 1:
            raise ValueError(
                "give exactly one of 'path: CHECKPOINT_DIR', 'gguf: FILE_OR_WHEEL' and 'build: {hidden_size: ...}'"
            )
        if self.gguf_member is not None and self.gguf is None:
            raise ValueError("'gguf_member' applies to 'gguf: ARCHIVE'")
        return self


#: Default ``warm_start.abstain_reply`` candidates: the first that earns no reward on any stage is used.
ABSTAIN_REPLIES: tuple[str, ...] = ("(I don't know)", "(I DON'T KNOW)", "(no answer)", "(NO ANSWER)")


class WarmStartAcceptance(_Strict):
    """When a warm start is done: checks on held-out rows every ``every`` steps up to a cap (docs/recipes.md)."""

    check_size: int = Field(64, ge=1)
    pass_k: int = Field(4, ge=1)
    pass_reward: float = 1.0
    min_pass: float = Field(0.5, ge=0, le=1)
    every: int = Field(100, ge=1)
    max_steps: int = Field(2000, ge=1)
    abstain_every: int = Field(25, ge=1)
    abstain_max_steps: int = Field(400, ge=1)
    decline_tolerance: float = Field(0.1, ge=0, le=1)
    temperature: float = Field(1.0, gt=0)
    max_new_tokens: int = Field(32, ge=1)
    seed: int = Field(0, ge=0, le=MAX_SEED)


class WarmStartSpec(_Strict):
    """A short supervised warm start of the base on the stages' rows (loss on the answer); base of every stage."""

    steps: int = Field(300, ge=1)
    batch_size: int = Field(32, ge=1)
    learning_rate: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    save_dtype: FloatDtype = "bfloat16"
    abstain_share: float = Field(0.0, ge=0, lt=1)
    abstain_steps: int = Field(200, ge=1)
    abstain_learning_rate: float = Field(1e-3, gt=0)
    abstain_reply: str | None = Field(None, min_length=1)
    accept: WarmStartAcceptance | None = None

    @model_validator(mode="after")
    def _cap_after_the_first_check(self) -> WarmStartSpec:
        if self.accept is not None and self.accept.max_steps < self.steps:
            raise ValueError(
                f"accept.max_steps ({self.accept.max_steps}) caps phase one below its first check at steps "
                f"({self.steps}): make it at least steps"
            )
        if self.accept is not None and self.abstain_share and self.accept.abstain_max_steps < self.abstain_steps:
            raise ValueError(
                f"accept.abstain_max_steps ({self.accept.abstain_max_steps}) caps phase two below its first check at "
                f"abstain_steps ({self.abstain_steps}): make it at least abstain_steps"
            )
        return self

    @field_validator("abstain_reply")
    @classmethod
    def _one_line(cls, value: str | None) -> str | None:
        if value is not None and ("\n" in value or not value.strip()):
            raise ValueError("abstain_reply must be one non-blank line (rewards read a completion's first line)")
        return value


class PromptSpec(_Strict):
    """A stage's prompts: generated (``generator``) or read from JSON Lines files."""

    generator: str | None = None
    kwargs: dict[str, Any] = Field(default_factory=dict)
    train_size: int = Field(256, ge=1)
    eval_size: int = Field(64, ge=0)
    val_size: int | None = Field(None, ge=0)
    seed: int = Field(0, ge=0, le=MAX_SEED - 2)
    warm_size: int = Field(0, ge=0)
    train_file: str | None = None
    eval_file: str | None = None
    val_file: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> PromptSpec:
        files = self.train_file or self.eval_file or self.val_file
        if self.generator is not None and files:
            raise ValueError("give either 'generator:' or 'train_file:'/'eval_file:'/'val_file:', not both")
        if self.generator is None and not files:
            raise ValueError("give 'generator: package.module:function' or 'train_file:'/'eval_file:' (JSON Lines)")
        if self.generator is None and self.val_size:
            raise ValueError("val_size applies to a generator; with files, give 'val_file:' (JSON Lines)")
        return self

    @property
    def validation_size(self) -> int:
        """Validation prompts drawn from the generator: ``val_size``, or ``eval_size`` when it is not given."""
        return self.eval_size if self.val_size is None else self.val_size


class PreviewSpec(_Strict):
    """The merge preview of a trained stage (:class:`~ram_trl.callbacks.preview.MergePreviewCallback`)."""

    every: int | None = Field(None, ge=1)
    prompts: int | None = Field(defaults.PREVIEW_PROMPTS, ge=1)
    method: str = defaults.PREVIEW_METHOD
    parameters: dict[str, Any] = Field(default_factory=dict)
    keep: Literal["best", "last"] = "best"


class StageSpec(_Strict):
    """One vertical: an RL run from the base (or, for merge-only recipes, an existing agent ``checkpoint``)."""

    name: str = Field(pattern=_NAME_PATTERN)
    domain: str | None = None
    prompts: PromptSpec | None = None
    rewards: list[str] = Field(default_factory=list)
    trainer: Literal["grpo", "rloo"] = "grpo"
    config: dict[str, Any] = Field(default_factory=dict)
    peft: dict[str, Any] | None = None
    accelerate_config: str | None = None
    save_dtype: FloatDtype = "bfloat16"
    checkpoint: str | None = None
    hub_id: str | None = None
    preview: PreviewSpec | None = None

    @model_validator(mode="after")
    def _trainable(self) -> StageSpec:
        if "output_dir" in self.config:
            raise ValueError("config.output_dir is set by the runner (RUN_DIR/stages/NAME); remove it")
        if self.checkpoint is None:
            if self.prompts is None:
                raise ValueError("a trained stage needs 'prompts:' (or give 'checkpoint:' for an existing agent)")
            if not self.rewards:
                raise ValueError("a trained stage needs 'rewards: [package.module:function, ...]'")
        elif self.preview is not None:
            raise ValueError("'preview:' applies to a trained stage; this one has an existing 'checkpoint:'")
        return self

    @property
    def has_validation(self) -> bool:
        """Whether the stage has validation prompts (``val_file``, or a generator with a validation size > 0)."""
        if self.prompts is None:
            return False
        if self.prompts.generator is None:
            return self.prompts.val_file is not None
        return self.prompts.validation_size > 0

    @property
    def trained(self) -> bool:
        return self.checkpoint is None


class MergeSpec(_Strict):
    """One merge method to compare; a parameter given as a list sweeps it (one row per combination)."""

    method: str
    parameters: dict[str, Any] = Field(default_factory=dict)
    name: str | None = Field(default=None, pattern=_NAME_PATTERN)
    fisher: dict[str, Any] = Field(default_factory=dict)
    out_dtype: Literal["float32", "bfloat16", "float16"] | None = None

    @field_validator("parameters")
    @classmethod
    def _sweeps(cls, value: dict[str, Any]) -> dict[str, Any]:
        for key, item in value.items():
            if isinstance(item, list) and not item:
                raise ValueError(f"parameter {key!r} sweeps an empty list; give at least one value")
            if isinstance(item, dict):
                raise ValueError(f"parameter {key!r}: give a value or a list of values to sweep, not a mapping")
        return value


class MergeRow(BaseModel):
    """One merge to run: a method with scalar parameters, and its row label."""

    name: str
    method: str
    parameters: dict[str, Any]
    fisher: dict[str, Any] = Field(default_factory=dict)
    out_dtype: str = "float32"


class AnalysisSpec(_Strict):
    """Parameters of ``ram-trl analyze`` over the agents (eps, and r/alpha for the implied lambda_t)."""

    enabled: bool = True
    eps: float = Field(defaults.EPS, ge=0)
    r: float = Field(defaults.R, ge=0)
    alpha: float = Field(defaults.ALPHA, ge=0)


class Recipe(_Strict):
    """A specialize-then-merge recipe; ``merge_dtype`` (default float32) is the merges' write and score dtype."""

    name: str = Field(pattern=_NAME_PATTERN)
    description: str | None = None
    output_dir: str | None = None
    seed: int = Field(0, ge=0, le=MAX_SEED)
    torch_threads: int | None = Field(None, ge=1)
    base: BaseSpec
    warm_start: WarmStartSpec | None = None
    stages: list[StageSpec]
    merges: list[MergeSpec] = Field(default_factory=lambda: [MergeSpec(method=m) for m in DEFAULT_METHODS])
    merge_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    analysis: AnalysisSpec = Field(default_factory=AnalysisSpec)
    evaluation: EvaluationSpec = Field(default_factory=EvaluationSpec)

    @field_validator("merges", mode="before")
    @classmethod
    def _strings(cls, value: Any) -> Any:
        if isinstance(value, list):
            return [{"method": item} if isinstance(item, str) else item for item in value]
        return value

    @field_validator("stages")
    @classmethod
    def _distinct(cls, value: list[StageSpec]) -> list[StageSpec]:
        if not value:
            raise ValueError("'stages' is empty: give at least one stage")
        names = [s.name for s in value]
        for name in names:
            if names.count(name) > 1:
                raise ValueError(f"stage name {name!r} is used twice; stage names must be distinct")
        return value

    @model_validator(mode="after")
    def _warm_start_needs_answers(self) -> Recipe:
        if self.warm_start is not None and not any(s.trained for s in self.stages):
            raise ValueError("warm_start needs at least one trained stage (its prompts are the warm-start data)")
        return self

    @model_validator(mode="after")
    def _previews_have_validation(self) -> Recipe:
        trained: list[StageSpec] = []
        for stage in self.stages:
            if not stage.trained:
                continue
            trained.append(stage)
            if stage.preview is None:
                continue
            if not self.evaluation.enabled:
                raise ValueError(f"stage {stage.name!r}: 'preview:' scores prompts; evaluation.enabled is false")
            for other in trained:
                if not other.has_validation:
                    raise ValueError(
                        f"stage {stage.name!r}: 'preview:' scores every merged stage on its validation prompts, "
                        f"and stage {other.name!r} has none (give prompts.val_size > 0 or prompts.val_file)"
                    )
        return self

    def stage(self, name: str) -> StageSpec:
        """The stage called ``name``."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise ConfigError(f"recipe {self.name!r} has no stage {name!r}; stages: {', '.join(self.names)}")

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.stages]


def _format_errors(exc: ValidationError) -> str:
    return validation_message(exc, Recipe)


def load_recipe(
    source: str | os.PathLike | dict[str, Any], overrides: dict[str, Any] | None = None
) -> tuple[Recipe, Path]:
    """Read and validate a recipe (schema only; :func:`validate_recipe` checks the environment)."""
    if isinstance(source, dict):
        data, where, root = source, "recipe", Path.cwd()
    else:
        path = Path(source).expanduser()
        where, root = f"recipe {path}", path.resolve().parent
        if not path.is_file():
            raise ConfigError(f"{where} does not exist")
        try:
            data = yaml.safe_load(path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise ConfigError(f"{where}: not valid YAML ({exc})") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping at the top level (name:, base:, stages:, ...)")
    if overrides:
        data = apply_overrides(data, overrides)
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{where}: {_format_errors(exc)}") from None
    check_row_names(recipe, where)
    return recipe, root


RESERVED_NAMES = ("base", "average")  #: Not stage names: the base model's row, the mean over stages.


def check_row_names(recipe: Recipe, where: str = "recipe") -> None:
    """Refuse names that collide in the results (reserved names, merge rows, equal up to case)."""
    rows = [("base", "the base model's row")]
    rows += [(stage.name, f"stage {stage.name!r}") for stage in recipe.stages]
    try:
        rows += [(row.name, f"merge row {row.name!r}") for row in expand_merges(recipe)]
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for stage in recipe.stages:
        if stage.name.lower() in RESERVED_NAMES:
            raise ConfigError(
                f"{where}: stages: the name {stage.name!r} is reserved for the results' {stage.name.lower()!r} row; "
                "rename the stage"
            )
    seen: dict[str, str] = {}
    for name, what in rows:
        other = seen.setdefault(name.lower(), what)
        if other != what:
            raise ConfigError(
                f"{where}: {what} and {other} would share a row of the results (and eval/{name}.json); rename one "
                "(a merge entry takes a 'name:')"
            )


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``overrides`` merged in (mappings key by key; ``stages: {"*": {...}}`` updates every stage)."""
    out = dict(data)
    for key, value in overrides.items():
        current = out.get(key)
        if key == "stages" and isinstance(value, dict) and isinstance(current, list):
            out[key] = [
                apply_overrides(stage, value.get("*", {})) if isinstance(stage, dict) else stage for stage in current
            ]
        elif isinstance(value, dict) and isinstance(current, dict):
            out[key] = apply_overrides(current, value)
        else:
            out[key] = value
    return out


def _fmt(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


def expand_merges(recipe: Recipe) -> list[MergeRow]:
    """Expand the sweeps of ``recipe.merges`` into one :class:`MergeRow` per merge to run."""
    rows: list[MergeRow] = []
    for spec in recipe.merges:
        swept = [k for k, v in spec.parameters.items() if isinstance(v, list)]
        fixed = {k: v for k, v in spec.parameters.items() if k not in swept}
        label = spec.name or spec.method
        for values in itertools.product(*(spec.parameters[k] for k in swept)):
            point = dict(zip(swept, values, strict=True))
            suffix = ",".join(f"{k}={_fmt(v)}" for k, v in point.items())
            name = f"{label}({suffix})" if suffix else label
            rows.append(
                MergeRow(
                    name=name,
                    method=spec.method,
                    parameters={**fixed, **point},
                    fisher=spec.fisher,
                    out_dtype=spec.out_dtype or recipe.merge_dtype,
                )
            )
    names = [r.name for r in rows]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"merges: two entries make the row {name!r}; give one of them a 'name:'")
    return rows
