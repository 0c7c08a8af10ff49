"""ram_trl/evaluation/rewards.py: reward functions wrapped so that failures name the stage and the function."""

from __future__ import annotations

import pytest

from ram_trl.errors import ConfigError, RamTrlError
from ram_trl.evaluation.rewards import StageFailure, check_reward_values, wrap_reward


def length_reward(completions, **kwargs):
    return [len(c) for c in completions]


def test_values_pass_through_as_floats():
    reward = wrap_reward(length_reward, "pkg.mod:length_reward", "coding")
    values = reward(completions=["ab", "abcd", ""], prompts=["p"] * 3)
    assert values == [2.0, 4.0, 0.0]
    assert all(type(v) is float for v in values)
    assert reward.__name__ == "length_reward"  # TRL logs rewards under the function's name


def test_positional_completions_and_none_kept():
    reward = wrap_reward(lambda completions: [None, 1], "pkg:anon", "tools")
    assert reward(["x", "y"]) == [None, 1.0]


def test_an_exception_names_the_stage_and_function():
    def broken(completions, **kwargs):
        raise KeyError("answer")

    reward = wrap_reward(broken, "pkg.mod:broken", "memory")
    with pytest.raises(StageFailure) as info:
        reward(completions=["a"])
    assert str(info.value) == "stage 'memory': reward function pkg.mod:broken raised KeyError('answer')"
    assert isinstance(info.value.__cause__, KeyError)
    assert isinstance(info.value, RamTrlError) and isinstance(info.value, RuntimeError)


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (1.0, "stage 'coding': reward function pkg:f returned float; return a list with one float per completion"),
        ([1.0], "stage 'coding': reward function pkg:f returned 1 values for 2 completions"),
        ([1.0, float("nan")], "stage 'coding': reward function pkg:f"),
    ],
)
def test_malformed_outputs_become_stage_failures(returned, message):
    reward = wrap_reward(lambda completions, **kwargs: returned, "pkg:f", "coding")
    with pytest.raises(StageFailure) as info:
        reward(completions=["a", "b"])
    assert message in str(info.value)
    assert info.value.__cause__ is None


def test_reward_values():
    assert check_reward_values((1, None, 0.5), 3, "f") == [1.0, None, 0.5]
    with pytest.raises(ConfigError, match="^f returned str; return a list"):
        check_reward_values("0.5", 1, "f")
    with pytest.raises(ConfigError, match="^f returned 2 values for 3 completions"):
        check_reward_values([1.0, 2.0], 3, "f")
    with pytest.raises(ConfigError, match="^f"):
        check_reward_values([float("inf")], 1, "f")
