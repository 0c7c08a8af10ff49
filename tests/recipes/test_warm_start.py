"""The warm start's abstaining rows: the seeded draw, the recipe fields that set it, and the refusal of a reply that
earns a reward."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from ram_trl.recipes.schema import WarmStartSpec
from ram_trl.recipes.warm_start import with_abstentions


def _rows(n: int, task: str) -> list[dict[str, str]]:
    return [{"prompt": f"{task}{i}", "answer": str(i)} for i in range(n)]


def test_with_abstentions_replaces_a_seeded_share_and_keeps_the_input():
    rows = _rows(2000, "a") + _rows(2000, "b")
    before = [dict(r) for r in rows]
    out = with_abstentions(rows, 0.4, "(I don't know)", seed=0)
    assert rows == before  # the input rows are not modified
    assert out == with_abstentions(rows, 0.4, "(I don't know)", seed=0)
    assert out != with_abstentions(rows, 0.4, "(I don't know)", seed=1)
    assert [r["prompt"] for r in out] == [r["prompt"] for r in rows]
    abstained = [r["answer"] == "(I don't know)" for r in out]
    # a Bernoulli(0.4) draw per row: 1600 expected of 4000, sd 31; each task abstains at about the same rate
    assert 1450 < sum(abstained) < 1750
    assert abs(sum(abstained[:2000]) - sum(abstained[2000:])) < 150
    kept = [o for o, r in zip(out, rows, strict=True) if o["answer"] != "(I don't know)"]
    assert all(
        o == r for o, r in zip(kept, [r for r, a in zip(rows, abstained, strict=True) if not a], strict=True)
    )


def test_with_abstentions_share_zero_is_the_identity():
    rows = _rows(50, "a")
    assert with_abstentions(rows, 0.0, "x", seed=0) == rows


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"abstain_share": 1.0}, "less than 1"),
        ({"abstain_share": -0.1}, "greater than or equal to 0"),
        ({"abstain_share": float("nan")}, "abstain_share"),
        ({"abstain_reply": "two\nlines"}, "one non-blank line"),
        ({"abstain_reply": "   "}, "one non-blank line"),
        ({"abstain_reply": ""}, "at least 1 character"),
    ],
)
def test_abstention_fields_are_validated(fields, message):
    with pytest.raises(ValidationError, match=message):
        WarmStartSpec(**fields)


def test_abstention_defaults_are_off():
    spec = WarmStartSpec()
    assert spec.abstain_share == 0.0
    assert spec.abstain_reply == "(I don't know)"


def test_a_reply_that_earns_a_reward_is_refused_before_the_warm_start(tmp_path):
    from ram_trl.errors import ConfigError
    from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES
    from ram_trl.recipes.runner import RunOptions, run_recipe
    from ram_trl.recipes.schema import apply_overrides

    overrides = apply_overrides(QUICK_OVERRIDES, {"warm_start": {"abstain_share": 0.5, "abstain_reply": "7"}})
    options = RunOptions(out=tmp_path / "run", progress=False, figures=False, overrides=overrides)
    # "7" starts some sums (partial credit on coding): an abstention must earn nothing on every stage
    with pytest.raises(
        ConfigError, match=r"abstain_reply '7' earns a reward on stage 'coding' \(test mean 0\.\d+\)"
    ):
        run_recipe(DEMO_RECIPE, options)
    assert not (tmp_path / "run" / "base" / "config.json").exists()
