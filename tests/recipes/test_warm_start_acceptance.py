"""The warm start's acceptance criterion (hand-computed checks, the cap, the record) and ``ram-trl demo --seed``."""

from __future__ import annotations

import json

import pytest

from ram_trl.recipes.schema import WarmStartAcceptance, WarmStartSpec
from ram_trl.recipes.warm_start import (
    AcceptanceCallback,
    acceptance_summary,
    criterion,
    decline_target,
    pass_at_k,
    phase_met,
)


def _train(callback: AcceptanceCallback, values: list[dict[str, float]], max_steps: int) -> int:
    """The trainer's loop around ``callback`` (one ``on_step_end`` per optimizer step) with scripted measurements;
    the steps trained."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    measured = iter(values)
    callback.measure = lambda: next(measured)
    state, control = TrainerState(), TrainerControl()
    args = TrainingArguments(output_dir="unused", report_to="none")
    for step in range(1, max_steps + 1):
        state.global_step = step
        callback.on_step_end(args, state, control)
        if control.should_training_stop:
            return step
    return max_steps


def test_pass_at_k_counts_rows_with_any_passing_sample():
    # rows: pass on the 3rd sample, never, on the 1st, on two: 3 of 4 rows
    assert pass_at_k([[False, False, True, False], [False] * 4, [True, False, False, False], [True, True]]) == 0.75
    assert pass_at_k([]) == 0.0


def test_phase_met_every_stage_or_the_mean():
    assert phase_met({"a": 0.5, "b": 0.9}, 0.5)
    assert not phase_met({"a": 0.49, "b": 0.9}, 0.5)  # one stage short: not met, whatever the mean (0.695)
    assert phase_met({"a": 0.2, "b": 0.6}, 0.4, how="mean")  # mean 0.4 reaches 0.4
    assert not phase_met({"a": 0.2, "b": 0.59}, 0.4, how="mean")
    assert not phase_met({}, 0.0)


def test_the_callback_stops_training_at_the_first_check_that_meets_the_criterion():
    reported = []
    callback = AcceptanceCallback(
        None,
        lambda v: phase_met(v, 0.5),
        first=600,
        every=100,
        cap=1500,
        on_check=lambda step, values: reported.append((step, values["a"])),
    )
    trained = _train(callback, [{"a": 0.2}, {"a": 0.4}, {"a": 0.6}, {"a": 0.9}], max_steps=1500)
    assert trained == 800  # checks at 600, 700, 800: met at 800, the trainer stops there
    assert reported == [(600, 0.2), (700, 0.4), (800, 0.6)]
    out = callback.record()
    assert out["steps"] == 800 and out["met"] is True and out["cap"] == 1500
    assert [c["step"] for c in out["checks"]] == [600, 700, 800]
    assert [c["values"]["a"] for c in out["checks"]] == [0.2, 0.4, 0.6]


def test_the_callback_checks_at_the_cap_and_flags_it():
    callback = AcceptanceCallback(None, lambda v: phase_met(v, 0.5), first=600, every=100, cap=750)
    assert _train(callback, [{"a": 0.1}] * 10, max_steps=750) == 750
    out = callback.record()
    assert out["steps"] == 750 and out["met"] is False
    assert [c["step"] for c in out["checks"]] == [600, 700, 750]  # the last check is at the cap
    # a first check past the cap is moved to the cap
    callback = AcceptanceCallback(None, lambda v: phase_met(v, 0.5), first=600, every=100, cap=300)
    assert _train(callback, [{"a": 0.9}], max_steps=300) == 300
    assert callback.record()["steps"] == 300 and callback.record()["met"] is True


def test_criterion_and_decline_target_in_words():
    spec = WarmStartSpec(steps=600, abstain_share=0.5, accept=WarmStartAcceptance(min_pass=0.35))
    assert decline_target(spec) == 0.4
    assert criterion(spec) == (
        "every stage's sampled pass@4 (temperature 1, summed reward >= 1) on its 64 check rows >= 0.35, checked "
        "after 600 steps and every 100 after, cap 2000; then greedy declines on >= 0.4 of the check rows (mean over "
        "stages), checked after 200 steps and every 25 after, cap 400"
    )
    assert decline_target(spec.model_copy(update={"abstain_share": 0.05})) == 0.0


def test_the_summary_shouts_when_a_cap_was_hit():
    acceptance = {
        "phases": {
            "answers": {"steps": 1500, "cap": 1500, "met": False, "checks": [{"step": 1500, "values": {"a": 0.1}}]},
            "abstain": {"steps": 50, "cap": 300, "met": True, "checks": [{"step": 50, "values": {"a": 0.45}}]},
        },
        "final": {"pass_at_k": {"a": 0.125}, "decline": {"a": 0.5}},
    }
    lines = acceptance_summary(acceptance)
    assert lines[0].startswith("WARNING: phase one (answers): sampled pass@k NOT met: the cap of 1500 steps was hit")
    assert lines[1] == "phase two (abstentions): greedy declines met after 50 steps (cap 300): a 0.45"
    assert lines[2] == "saved base: sampled pass@k a 0.12; greedy declines a 0.50"


def test_acceptance_fields_are_validated():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="min_pass"):
        WarmStartAcceptance(min_pass=1.5)
    with pytest.raises(ValidationError, match="pass_k"):
        WarmStartAcceptance(pass_k=0)
    assert WarmStartSpec().accept is None  # off by default: recipes without it train exactly `steps`
    with pytest.raises(ValidationError, match=r"accept.max_steps \(500\) caps phase one below its first check"):
        WarmStartSpec(steps=600, accept=WarmStartAcceptance(max_steps=500))


def test_a_warm_start_that_hits_its_cap_is_flagged_and_recorded(tmp_path, capsys):
    import torch

    from ram_trl.evaluation.scoring import EvalTask
    from ram_trl.recipes.warm_start import WARM_START_RECORD, warm_start
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64, dtype=torch.float32)
    rows = [{"prompt": f"{i}=", "answer": "ab"} for i in range(40)]
    checks = [
        EvalTask(
            "t",
            [{"prompt": f"{i}=", "answer": "ab"} for i in range(40, 44)],
            ["ram_trl.recipes.tasks:recall_reward"],
            split="check",
        )
    ]
    accept = WarmStartAcceptance(
        check_size=4,
        pass_k=2,
        pass_reward=2.0,
        every=5,
        max_steps=12,
        abstain_every=4,
        abstain_max_steps=8,
        decline_tolerance=1.0,
        max_new_tokens=4,
    )  # pass_reward 2 is out of reach (recall_reward gives at most 1): phase one must stop at its cap
    spec = WarmStartSpec(
        steps=5,
        batch_size=8,
        learning_rate=1e-2,
        save_dtype="float32",
        abstain_share=0.5,
        abstain_reply="zz",
        abstain_steps=6,
        abstain_learning_rate=1e-2,
        accept=accept,
    )
    reported = []
    with pytest.warns(UserWarning, match="phase 'answers' hit its cap of 12 steps"):
        record = warm_start(
            tmp_path / "init",
            tmp_path / "out",
            rows,
            spec,
            progress=True,
            checks=checks,
            on_check=lambda phase, step, values: reported.append((phase, step)),
        )
    bars = capsys.readouterr().err  # the checks (generation, minutes on a busy CPU) have their bar too
    assert "warm start check (answers)" in bars and "warm start check (declines)" in bars
    assert reported == [("answers", 5), ("answers", 10), ("answers", 12), ("abstain", 6)]
    saved = json.loads((tmp_path / "out" / WARM_START_RECORD).read_text())
    acceptance = saved["acceptance"]
    assert acceptance == record["acceptance"]
    assert acceptance["accepted"] is False
    answers, abstain = acceptance["phases"]["answers"], acceptance["phases"]["abstain"]
    assert (answers["steps"], answers["met"], [c["step"] for c in answers["checks"]]) == (12, False, [5, 10, 12])
    assert all(c["values"] == {"t": 0.0} for c in answers["checks"])
    # target max(0, 0.5 - 1.0) = 0: met at the first check, after abstain_steps
    assert (abstain["steps"], abstain["met"], [c["step"] for c in abstain["checks"]]) == (6, True, [6])
    assert saved["steps"] == 18  # 12 + 6 steps taken, not spec.steps + spec.abstain_steps
    assert set(acceptance["final"]) == {"pass_at_k", "decline"}
    assert acceptance["check_rows"] == {"t": 4}
    assert acceptance["criterion"] == criterion(spec)


def test_a_met_criterion_stops_the_trainer_and_the_process_random_state_is_left_alone(tmp_path):
    import os
    import random

    import numpy as np
    import torch

    from ram_trl.evaluation.scoring import EvalTask
    from ram_trl.recipes.warm_start import warm_start
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64, dtype=torch.float32)
    rows = [{"prompt": f"{i}=", "answer": "ab"} for i in range(40)]
    checks = [EvalTask("t", rows[:2], ["ram_trl.recipes.tasks:recall_reward"], split="check")]
    # min_pass 0: met at the first check (step 3); without the stop the trainer would run to the cap of 200 steps
    accept = WarmStartAcceptance(check_size=2, pass_k=1, min_pass=0.0, every=5, max_steps=200, max_new_tokens=2)
    spec = WarmStartSpec(steps=3, batch_size=8, learning_rate=1e-2, save_dtype="float32", accept=accept)
    import rich.style  # noqa: F401  (its first import, through the trainer, draws from Python's random)

    random.seed(7), np.random.seed(7), torch.manual_seed(7)
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    environment = dict(os.environ)
    record = warm_start(tmp_path / "init", tmp_path / "out", rows, spec, progress=False, checks=checks)
    answers = record["acceptance"]["phases"]["answers"]
    assert (answers["steps"], answers["met"], [c["step"] for c in answers["checks"]]) == (3, True, [3])
    assert record["steps"] == 3  # the trainer logged 3 steps' losses: it stopped at the check
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    # the trainer seeds Python, NumPy and torch globally: the warm start restores them
    assert after[0] == before[0] and (after[1] == before[1]).all() and torch.equal(after[2], before[2])
    assert dict(os.environ) == environment


def test_the_check_measures_the_weights_rounded_to_the_saved_dtype(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from ram_trl.recipes.warm_start import _Checker
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32)
    spec = WarmStartSpec(save_dtype="bfloat16", accept=WarmStartAcceptance())
    checker = _Checker(tmp_path / "init", model, [], spec, progress=False, write=print)
    add_fused_lm_head(model)  # what SFTTrainer does to the model it trains
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 1e-3)
    ids = torch.tensor([[3, 4, 5, 6]])
    rounded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32).eval()
    rounded.load_state_dict(model.state_dict())
    rounded.to(torch.bfloat16).to(torch.float32)
    measured = checker._copy(model)(ids).logits
    assert torch.equal(measured, rounded(ids).logits)
    assert not torch.equal(measured, model.eval()(ids).logits)  # not the float32 weights being trained


def test_accept_needs_check_rows(tmp_path):
    from ram_trl.errors import ConfigError
    from ram_trl.recipes.warm_start import warm_start
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64)
    spec = WarmStartSpec(steps=2, accept=WarmStartAcceptance())
    with pytest.raises(ConfigError, match="accept needs check rows"):
        warm_start(tmp_path / "init", tmp_path / "out", [{"prompt": "1=", "answer": "a"}], spec, progress=False)
    assert not (tmp_path / "out").exists()


# -- seeds -----------------------------------------------------------------------------------------------------
def _seeds(data, path=""):
    """Every field whose name says it is a seed, with its path."""
    if isinstance(data, dict):
        for key, value in data.items():
            if "seed" in key and isinstance(value, int):
                yield f"{path}.{key}", value
            yield from _seeds(value, f"{path}.{key}")
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from _seeds(value, f"{path}[{i}]")


def _demo_overrides(monkeypatch, argv):
    from ram_trl import cli
    from ram_trl.recipes import runner

    seen = {}
    monkeypatch.setattr(runner, "run_recipe", lambda recipe, options: seen.update(options=options))
    assert cli.main(["demo", *argv]) == 0
    return seen["options"].overrides


@pytest.mark.parametrize("quick", [[], ["--quick"]])
def test_the_seed_flag_reaches_every_seed_of_the_run(monkeypatch, quick):
    from ram_trl.recipes import DEMO_RECIPE
    from ram_trl.recipes.schema import load_recipe

    recipe, _ = load_recipe(DEMO_RECIPE, _demo_overrides(monkeypatch, ["--seed", "3", *quick]))
    seeds = dict(_seeds(recipe.model_dump()))
    # the base, the warm start and its check, every stage's prompts, the trainers and merges, the evaluation
    for field in (".seed", ".base.build.seed", ".warm_start.seed", ".warm_start.accept.seed", ".evaluation.seed"):
        assert seeds.pop(field) == 3, field
    for i in range(len(recipe.stages)):
        assert seeds.pop(f".stages[{i}].prompts.seed") == 3
    assert seeds.pop(".evaluation.bootstrap_seed") == 3
    assert seeds == {}  # no seed left at its default: a new seed field must be derived from --seed too
    if quick:
        assert recipe.warm_start.steps == 20  # --quick still applies


@pytest.mark.parametrize("seed", ["4294967295", "-1"])
def test_a_seed_out_of_range_is_refused_naming_the_flag(monkeypatch, capsys, seed):
    from ram_trl import cli
    from ram_trl.recipes import runner

    monkeypatch.setattr(runner, "run_recipe", lambda recipe, options: None)
    assert cli.main(["demo", "--seed", seed]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == f"ram-trl demo: error: --seed {seed}: must be an integer from 0 to 4294967293", error


def test_without_the_seed_flag_the_demo_recipe_is_unchanged(monkeypatch):
    from ram_trl.recipes import DEMO_RECIPE, seed_overrides
    from ram_trl.recipes.schema import load_recipe

    assert _demo_overrides(monkeypatch, []) == {}
    default, _ = load_recipe(DEMO_RECIPE)
    assert load_recipe(DEMO_RECIPE, seed_overrides(0))[0] == default  # --seed 0 is the default run


def test_seeds_draw_different_splits_and_the_same_seed_the_same(tmp_path):
    from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES, seed_overrides
    from ram_trl.recipes.runner import Run, RunOptions
    from ram_trl.recipes.schema import apply_overrides, load_recipe

    def drawn(seed):
        recipe, root = load_recipe(DEMO_RECIPE, apply_overrides(QUICK_OVERRIDES, seed_overrides(seed)))
        return Run(recipe, root, tmp_path / f"run{seed}", RunOptions(progress=False)).preparation.draw()

    zero, again, one = drawn(0), drawn(0), drawn(1)
    assert zero == again
    for stage, (train, test, val, warm, check) in zero.items():
        assert train != one[stage][0] and test != one[stage][1] and check != one[stage][4], stage
        # the check rows: held out of the warm start, never a training, test or validation prompt
        prompts = {r["prompt"] for r in check}
        assert len(check) == 4
        assert not prompts & {r["prompt"] for r in train + test + val + warm}, stage


def test_check_rows_skip_training_prompts_and_leave_the_warm_start():
    from ram_trl.recipes.data import split_check_rows

    warm = [{"prompt": p, "answer": p.upper()} for p in ["a", "b", "c", "d", "b", "e"]]
    train = [{"prompt": "a"}, {"prompt": "c"}]
    kept, check = split_check_rows(warm, train, 2)
    assert [r["prompt"] for r in check] == ["b", "d"]  # the first two warm rows that are not training prompts
    assert [r["prompt"] for r in kept] == ["a", "c", "e"]  # no row of a check prompt is trained on (the 2nd "b")
    assert split_check_rows(warm, train, 10)[1] == [r for r in warm if r["prompt"] not in "ac"]


def test_without_a_bar_the_steps_and_checks_are_lines_with_the_time_left(tmp_path, capsys):
    import torch

    from ram_trl.evaluation.scoring import EvalTask
    from ram_trl.recipes.warm_start import warm_start
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64, dtype=torch.float32)
    rows = [{"prompt": f"{i}=", "answer": "ab"} for i in range(40)]
    reward = ["ram_trl.recipes.tasks:recall_reward"]
    checks = [EvalTask("t", rows[:2], reward, split="check"), EvalTask("u", rows[2:4], reward, split="check")]
    # pass_reward 2 is out of reach: checks at 20, 23 and the cap 26, then the final measurement
    accept = WarmStartAcceptance(check_size=2, pass_k=1, pass_reward=2.0, every=3, max_steps=26, max_new_tokens=2)
    spec = WarmStartSpec(steps=20, batch_size=8, learning_rate=1e-2, save_dtype="float32", accept=accept)
    lines = []
    with pytest.warns(UserWarning, match="hit its cap of 26 steps"):
        warm_start(tmp_path / "init", tmp_path / "out", rows, spec, progress=False, checks=checks, write=lines.append)
    check = ["warm start check (answers) 1/2: t", "warm start check (answers) 2/2: u"]
    step = "warm start (answers): step"
    # a line every tenth of the steps to the first check (2), counted again from each check to the next
    assert [line.rsplit(" (", 1)[0] for line in lines] == [
        *[f"{step} {n}/20" for n in range(2, 21, 2)],
        *check,
        f"{step} 22/23",
        f"{step} 23/23",
        *check,
        f"{step} 25/26",
        f"{step} 26/26",
        *check,
        *check,
    ]
    ends = {"20/20", "23/23", "26/26", "2/2: u"}
    for line in lines:  # the time left, except where a count ends
        assert line.endswith("left)") != any(f" {end} (" in line for end in ends), line
    assert "warm start" not in capsys.readouterr().err  # no bar
