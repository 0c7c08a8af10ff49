"""ram_trl/evaluation/scoring.py: scoring completions with a stage's reward functions, by hand with the example tasks'
rewards (generation and whole-model evaluation run with a real tiny model in tests/callbacks/preview/)."""

from __future__ import annotations

import pytest

from ram_trl.evaluation.rewards import StageFailure
from ram_trl.evaluation.scoring import EvalTask, score_completions
from ram_trl.recipes.tasks import arithmetic_reward, recall_reward

ROWS = [{"prompt": "37+45=", "answer": "82"}, {"prompt": "2*3=", "answer": "6"}, {"prompt": "9-9=", "answer": "0"}]


def test_scores_are_sums_over_the_functions():
    completions = ["82", "7\nmore", "x"]
    # arithmetic: exact 1.0; "7" vs "6": no prefix right, 0; "x": 0. recall: exact match 1.0 else 0
    assert score_completions([arithmetic_reward], ROWS, completions) == [1.0, 0.0, 0.0]
    assert score_completions([arithmetic_reward, recall_reward], ROWS, completions) == [2.0, 0.0, 0.0]
    # "8" is half of "82" right from the left: 0.5 x 0.5
    assert score_completions([arithmetic_reward], ROWS[:1], ["8"]) == [0.25]


def test_none_scores_count_as_zero_and_columns_are_passed():
    seen = {}

    def reward(prompts, completions, answer, **kwargs):
        seen.update(prompts=prompts, answer=answer)
        return [None, 0.5, 1]

    assert score_completions([reward], ROWS, ["a", "b", "c"]) == [0.0, 0.5, 1.0]
    assert seen == {"prompts": ["37+45=", "2*3=", "9-9="], "answer": ["82", "6", "0"]}
    assert score_completions([], [], []) == []


def test_a_task_imports_and_wraps_its_reward_functions():
    task = EvalTask("math", ROWS, ["ram_trl.recipes.tasks:arithmetic_reward"], split="val")
    (fn,) = task.functions()
    assert fn.__name__ == "arithmetic_reward"
    assert score_completions(task.functions(), ROWS, ["82", "6", "0"]) == [1.0, 1.0, 1.0]
    with pytest.raises(StageFailure, match="stage 'math': reward function ram_trl.recipes.tasks:arithmetic_reward"):
        score_completions(task.functions(), ROWS, ["82"])  # one completion for three rows


def test_a_model_with_non_finite_weights_is_named_before_it_is_scored(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from ram_trl.evaluation.scoring import load_model
    from ram_trl.synthetic import make_base_checkpoint

    path = make_base_checkpoint(tmp_path / "model", hidden_size=16, num_layers=1, intermediate_size=32)
    load_model(path)  # finite: no warning (pytest's filterwarnings would not catch one, so check the next one)
    tensors = load_file(str(path / "model.safetensors"))
    name = sorted(tensors)[-1]
    tensors[name] = torch.full_like(tensors[name], float("nan"))
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=rf"model {path}: parameter .* holds NaN/Inf values"):
        load_model(path)
