"""The two precisions of the telemetry: density as trained and density as saved, and the save dtype ``"auto"``.

The golden run: a tiny Qwen2 whose only trained tensor is ``lm_head`` (vocab 100 x hidden 32), trained one AdamW step
at lr 1e-4 by a plain ``transformers.Trainer`` in float32. AdamW's first step moves every element with a non-zero
gradient by ``lr * g / (|g| + 1e-8)``, i.e. by 1e-4 (every lm_head element has one: softmax is positive everywhere).
Three rows in four start at ``3 * 2**-6 = 0.046875``, where one bf16 step is ``2**-12 = 2.4e-4``: a move of 1e-4 is
above eps = 1e-5 in float32 but rounds back to the base in bf16. Every fourth row starts at ``2**-16``, where the
move survives bf16. So, by hand: 3200 elements move in float32 and 800 in the bf16 save.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from ram_trl.callbacks.telemetry.precision import AUTO, auto_save_dtype, precision_record, rounding_warning

P = "task_vector/"
VOCAB, HIDDEN = 100, 32
LARGE, SMALL = 3 * 2**-6, 2**-16


def test_auto_is_the_training_dtype_and_float32_otherwise():
    assert auto_save_dtype([torch.bfloat16]) == torch.bfloat16
    assert auto_save_dtype([torch.float32]) == torch.float32
    assert auto_save_dtype([torch.bfloat16, torch.float32]) == torch.float32  # mixed: nothing rounds
    assert auto_save_dtype([torch.float64]) == torch.float32
    assert auto_save_dtype([]) == torch.float32


def test_the_warning_fires_below_half_kept_and_names_both_dtypes():
    def record(trained: int, saved: int) -> dict:
        metrics = {f"{P}density": trained / 1000, f"{P}active": trained, f"{P}density_saved": saved / 1000}
        return precision_record([torch.float32], torch.bfloat16, {**metrics, f"{P}active_saved": saved}, P)

    line = rounding_warning(record(570, 29))
    assert line is not None and line.startswith("save_dtype=bfloat16 keeps 2.9% ")
    assert "training (float32) moved 57.0%" in line
    assert rounding_warning(record(570, 285)) is None  # half kept: no warning
    assert rounding_warning(record(0, 0)) is None
    assert rounding_warning(precision_record([torch.float32], torch.float32, {}, P)) is None  # not measured


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from ram_trl.synthetic import make_base_checkpoint

    path = make_base_checkpoint(
        tmp_path_factory.mktemp("base") / "base", hidden_size=HIDDEN, num_layers=1, intermediate_size=64
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.lm_head.weight.shape == (VOCAB, HIDDEN)
    with torch.no_grad():
        model.lm_head.weight.fill_(LARGE)
        model.lm_head.weight[::4] = SMALL
    model.to(torch.bfloat16).save_pretrained(path)  # both values are bf16 numbers: the base is exact
    return path


def train_one_step(base, out, **callback_args):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, default_data_collator

    from ram_trl.callbacks import TaskVectorSparsityCallback

    tokenizer = AutoTokenizer.from_pretrained(base)
    ids = [tokenizer("abcabcab")["input_ids"][:8] for _ in range(4)]
    data = Dataset.from_dict({"input_ids": ids, "labels": ids, "attention_mask": [[1] * 8 for _ in ids]})
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name == "lm_head.weight")
    callback = TaskVectorSparsityCallback(base_model=base, every_n_steps=1, **callback_args)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=1,
        learning_rate=1e-4,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=default_data_collator,
        processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.bind(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return callback, [str(w.message) for w in caught if "save_dtype=" in str(w.message)]


@pytest.mark.slow
def test_a_bf16_save_rounds_three_moves_in_four_away(base, tmp_path):
    pytest.importorskip("datasets")
    from ram_trl.stage.manifest import read_manifest

    out = tmp_path / "bf16"
    callback, warned = train_one_step(base, out, save_dtype="bfloat16")
    last = callback.tracker.last
    numel = int(last[f"{P}numel"])
    assert last[f"{P}active"] == VOCAB * HIDDEN and last[f"{P}density"] == VOCAB * HIDDEN / numel
    assert last[f"{P}active_saved"] == VOCAB * HIDDEN / 4 and last[f"{P}density_saved"] == VOCAB * HIDDEN / 4 / numel
    telemetry = read_manifest(out).extra["telemetry"]
    assert telemetry["training_dtype"] == "float32" and telemetry["save_dtype"] == "bfloat16"
    assert telemetry["densities"] == {
        "training": {"dtype": "float32", "density": VOCAB * HIDDEN / numel, "active": VOCAB * HIDDEN},
        "saved": {"dtype": "bfloat16", "density": VOCAB * HIDDEN / 4 / numel, "active": VOCAB * HIDDEN // 4},
    }
    assert read_manifest(out).save_dtype == "bfloat16"
    assert len(warned) == 1 and warned[0].startswith("save_dtype=bfloat16 keeps ")


@pytest.mark.slow
def test_the_default_auto_save_keeps_every_move(base, tmp_path):
    pytest.importorskip("datasets")
    from safetensors import safe_open

    from ram_trl.stage.manifest import read_manifest

    out = tmp_path / "auto"
    callback, warned = train_one_step(base, out)
    assert AUTO == "auto" and callback.save_dtype == torch.float32
    last = callback.tracker.last
    assert last[f"{P}active"] == last[f"{P}active_saved"] == VOCAB * HIDDEN
    manifest = read_manifest(out)
    assert manifest.save_dtype == "float32" and manifest.extra["telemetry"]["training_dtype"] == "float32"
    assert manifest.extra["telemetry"]["densities"]["saved"]["active"] == VOCAB * HIDDEN
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.float32
    assert warned == []
