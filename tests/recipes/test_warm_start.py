"""The warm start's abstaining rows: the seeded draw, the recipe fields that set it, and the refusal of a reply that
earns a reward."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from ram_trl.errors import ConfigError
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
    assert all(o == r for o, r in zip(kept, [r for r, a in zip(rows, abstained, strict=True) if not a], strict=True))


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
    assert spec.abstain_reply is None  # the runner picks the first of ABSTAIN_REPLIES that no stage rewards


def test_a_reply_that_earns_a_reward_is_refused_before_the_warm_start(tmp_path):
    from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES
    from ram_trl.recipes.runner import RunOptions, run_recipe
    from ram_trl.recipes.schema import apply_overrides

    overrides = apply_overrides(QUICK_OVERRIDES, {"warm_start": {"abstain_share": 0.5, "abstain_reply": "7"}})
    options = RunOptions(out=tmp_path / "run", progress=False, figures=False, overrides=overrides)
    # "7" is the value asked for in some recall prompts: an abstention must earn nothing on every stage
    with pytest.raises(ConfigError, match=r"abstain_reply '7' earns a reward on stage 'memory' \(test mean 0\.\d+\)"):
        run_recipe(DEMO_RECIPE, options)
    assert not (tmp_path / "run" / "base" / "config.json").exists()


def test_the_default_reply_is_the_first_that_no_stage_rewards(tmp_path, monkeypatch):
    from ram_trl.recipes import DEMO_RECIPE
    from ram_trl.recipes.data import draw_splits, write_jsonl
    from ram_trl.recipes.runner import Run, RunOptions
    from ram_trl.recipes.schema import ABSTAIN_REPLIES, load_recipe

    examples = Path(__file__).resolve().parents[2] / "examples"
    monkeypatch.syspath_prepend(str(examples))
    for recipe_file, expected in (
        (DEMO_RECIPE, ABSTAIN_REPLIES[0]),
        # position_reward credits a reversed or sorted word whose 4th letter is "d" (as in "(I don't know)")
        (examples / "string-tasks.yaml", ABSTAIN_REPLIES[1]),
    ):
        recipe, root = load_recipe(recipe_file)
        run = Run(recipe, root, tmp_path / recipe.name, RunOptions(progress=False))
        for stage in recipe.stages:
            _, held, val = draw_splits(stage, root)
            write_jsonl(held, run.layout.dir / "data" / stage.name / "eval.jsonl")
            write_jsonl(val, run.layout.dir / "data" / stage.name / "val.jsonl")
        assert run.preparation.abstain_reply(None) == expected
        assert run.preparation.abstain_reply(expected) == expected
    with pytest.raises(ConfigError, match=r"abstain_reply \"\(I don't know\)\" earns a reward on stage 'reverse'"):
        run.preparation.abstain_reply(ABSTAIN_REPLIES[0])


def test_the_abstaining_phase_follows_the_answers_and_teaches_the_reply(tmp_path):
    import json

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ram_trl.recipes.warm_start import WARM_START_RECORD, warm_start
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64, dtype=torch.float32)
    rows = [{"prompt": f"{i}=", "answer": "ab"} for i in range(40)]
    common = {"batch_size": 16, "learning_rate": 1e-2, "save_dtype": "float32"}
    plain = warm_start(tmp_path / "init", tmp_path / "plain", rows, WarmStartSpec(steps=30, **common), progress=False)
    assert plain["steps"] == 30 and plain["abstaining_rows"] == 0
    spec = WarmStartSpec(
        steps=30, abstain_share=0.5, abstain_steps=40, abstain_learning_rate=1e-2, abstain_reply="zz", **common
    )
    record = warm_start(tmp_path / "init", tmp_path / "abstains", rows, spec, progress=False)
    assert record["steps"] == 70  # 30 on the answers, then 40 with half the rows abstaining
    assert record["abstaining_rows"] == sum(r["answer"] == "zz" for r in with_abstentions(rows, 0.5, "zz", 0))
    assert 10 < record["abstaining_rows"] < 30
    assert json.loads((tmp_path / "abstains" / WARM_START_RECORD).read_text())["spec"]["abstain_share"] == 0.5
    # the first phase is the plain warm start: same losses step for step
    assert record["loss_first"] == plain["loss_first"]

    def next_token_probs(path):
        model = AutoModelForCausalLM.from_pretrained(str(path))
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        ids = tokenizer("7=", return_tensors="pt", add_special_tokens=False)["input_ids"]
        probs = model(ids).logits[0, -1].softmax(-1)
        a, z = tokenizer.convert_tokens_to_ids(["a", "z"])
        return probs[a].item(), probs[z].item()

    plain_a, plain_z = next_token_probs(tmp_path / "plain")
    abstain_a, abstain_z = next_token_probs(tmp_path / "abstains")
    assert plain_a > 0.9 and plain_z < 0.01
    assert 0.2 < abstain_z < 0.8 and 0.2 < abstain_a < 0.8  # it answers or declines, about half and half


def _hand_loop(model, encoded, steps, lr, weight_decay, batch_size, rng, pad_id):
    """The reference: AdamW, cosine to 10% over ``steps``, clipping at 1, each batch drawn with ``rng.sample``."""
    import math

    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    for _ in range(steps):
        items = rng.sample(encoded, min(batch_size, len(encoded)))
        width = max(len(ids) for ids, _ in items)
        batch = {
            "input_ids": torch.tensor([ids + [pad_id] * (width - len(ids)) for ids, _ in items]),
            "labels": torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in items]),
            "attention_mask": torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in items]),
        }
        model(**batch).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)


def test_the_trainer_optimises_what_the_hand_written_loop_did(tmp_path):
    # SFTTrainer must reproduce the reference step for step: the same batches (independent draws from one seeded
    # generator across both phases, not an epoch shuffle), loss on the answers only, the schedule, clipping and
    # weight decay; each phase with a fresh optimizer. Rows of different lengths make padding and masking count.
    import random

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ram_trl.recipes.warm_start import encode_rows, warm_start
    from ram_trl.synthetic import make_base_checkpoint

    make_base_checkpoint(tmp_path / "init", hidden_size=32, num_layers=1, intermediate_size=64, dtype=torch.float32)
    rows = [{"prompt": f"{i}=" + "x" * (i % 5), "answer": "ab"[: 1 + i % 2] + str(i)} for i in range(12)]
    spec = WarmStartSpec(
        steps=5,
        batch_size=4,
        learning_rate=2e-2,
        weight_decay=0.1,
        seed=3,
        save_dtype="float32",
        abstain_share=0.5,
        abstain_steps=4,
        abstain_learning_rate=5e-3,
        abstain_reply="zz",
    )
    warm_start(tmp_path / "init", tmp_path / "out", rows, spec, progress=False)

    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "init"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32).train()
    rng, pad = random.Random(3), tokenizer.pad_token_id
    _hand_loop(model, encode_rows(tokenizer, rows), 5, 2e-2, 0.1, 4, rng, pad)
    mixed = encode_rows(tokenizer, with_abstentions(rows, 0.5, "zz", 3))
    _hand_loop(model, mixed, 4, 5e-3, 0.1, 4, rng, pad)
    trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).state_dict()
    start = AutoModelForCausalLM.from_pretrained(str(tmp_path / "init"), dtype=torch.float32).state_dict()
    for name, expected in model.state_dict().items():
        assert (expected - start[name]).abs().max() > 0.05, name  # every tensor moved far more than the tolerance
        torch.testing.assert_close(trained[name], expected, rtol=0, atol=2e-5, msg=name)
