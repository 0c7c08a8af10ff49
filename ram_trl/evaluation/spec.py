"""How a model is scored (:class:`EvaluationSpec`) and the strict pydantic base of the settings models."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from ram_trl.messages import canonical_dtype

__all__ = ["MAX_SEED", "EvaluationSpec", "FloatDtype", "StrictModel"]

#: A float dtype of weights, aliases accepted (``bf16``, ``fp16``, ``fp32``, ``torch.float16``, ...).
FloatDtype = Annotated[Literal["bfloat16", "float16", "float32"], BeforeValidator(canonical_dtype)]


MAX_SEED = 2**32 - 1  #: The largest seed numpy and torch accept (``seed``, ``evaluation.seed``, ...).


class StrictModel(BaseModel):
    """Unknown keys, NaN/Inf and booleans given for numbers are refused (YAML's ``.nan``, ``yes``)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_numbers(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, field in cls.model_fields.items():
                value = data.get(name)
                if isinstance(value, bool) and _numeric(field.annotation):
                    raise ValueError(f"{name}: must be a number, got {value!r}")
        return data


def _numeric(annotation: Any) -> bool:
    """Whether a field's type is a number (``int``, ``float``, optionally ``None``), not a ``bool``."""
    import typing

    options = typing.get_args(annotation) or (annotation,)
    return bool(options) and bool not in options and any(o in (int, float) for o in options)


class EvaluationSpec(StrictModel):
    """How held-out prompts are scored."""

    enabled: bool = True
    max_new_tokens: int = Field(32, ge=1)
    do_sample: bool = False
    temperature: float = Field(1.0, gt=0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    batch_size: int = Field(64, ge=1)
    dtype: FloatDtype = "float32"
    bootstrap_resamples: int = Field(2000, ge=100)
    bootstrap_seed: int = Field(0, ge=0, le=MAX_SEED)
    retention_min_gain: float = Field(0.02, ge=0)
