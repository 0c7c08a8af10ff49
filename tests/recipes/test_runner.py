"""End to end: the quick demo (all stages, analysis, merges, evaluation, files and rows), a failing stage, resume.

These run real TRL GRPOTrainer processes on tiny models built from configs (about a minute each on 2 cores).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import safe_open

from ram_trl.cli import main
from ram_trl.errors import ConfigError
from ram_trl.output import LOCK_FILE
from ram_trl.recipes.layout import stage_complete
from ram_trl.recipes.reuse import model_digest
from ram_trl.recipes.runner import RunOptions, StageError, run_recipe
from ram_trl.stage.manifest import fingerprint_checkpoint, read_manifest
from tests.helpers import dead_pid, leftovers

REPO = Path(__file__).resolve().parents[2]
STAGES = ["coding", "tools", "memory"]
MERGES = [
    "ram",
    "ram_1_over_n",
    "ram_plus(r=0.05)",
    "ram_plus(r=0.1)",
    "ram_plus(r=0.2)",
    "task_arithmetic(lambda=0.333)",
    "task_arithmetic(lambda=0.4)",
    "task_arithmetic(lambda=0.5)",
    "task_arithmetic(lambda=0.75)",
    "task_arithmetic(lambda=1)",
    "task_arithmetic(lambda=1.25)",
    "task_arithmetic(lambda=1.5)",
    "ta_matched",
    "ties",
    "ties_density_1",
    "unique_coding",
    "unique_tools",
    "unique_memory",
    "dare_linear",
    "dare_ties",
    "fisher",
]

pytestmark = [pytest.mark.slow]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory):
    """A finished ``ram-trl demo --quick --no-progress`` run; what it printed is ``demo.err`` beside it."""
    out = tmp_path_factory.mktemp("demo") / "run"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # the run's console writes to sys.stderr as it is at each line
        code = main(["demo", "--quick", "--out", str(out), "--no-progress"])
    (out.parent / "demo.err").write_text(err.getvalue(), encoding="utf-8")
    assert code == 0, err.getvalue()[-3000:]
    return out


def test_the_warm_start_prints_its_progress_as_lines_in_a_log_file(quick_demo):
    """recipes/prepare.py's warm start, as the module's quick demo ran it (here to share that run)."""
    err = (quick_demo.parent / "demo.err").read_text(encoding="utf-8")
    # the steps between the checks (a line every tenth of the 20 to the first check) and each check's stages
    for line in (
        "warm start (answers): step 2/20 (",
        "warm start (answers): step 20/20 (",
        "warm start check (answers) 3/3: memory (",
        "warm start (answers) step 20: sampled pass@k ",
        "warm start (abstain): step 1/10 (",
        "warm start check (declines) 3/3: memory (",
    ):
        assert line in err, line
    assert not [line for line in err.split("\n") if "warm start" in line and "\r" in line]  # no bar redrawn


def test_demo_seeds_summarizes_a_finished_run(quick_demo):
    """benchmarks/demo_seeds.py's table reads a finished demo (its paired gain intervals come from the same
    bootstrap samples as results.md's)."""
    import importlib.util

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "demo_seeds.py"
    spec = importlib.util.spec_from_file_location("demo_seeds", path)
    demo_seeds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo_seeds)
    summary = demo_seeds.summarize("seed0", quick_demo)
    results = json.loads((quick_demo / "results.json").read_text())
    assert sorted(summary["verticals"]) == sorted(STAGES) and summary["ship"] == results["selection"]["ship"]
    for stage, vertical in summary["verticals"].items():
        low, high = vertical["gain_interval"]
        assert low <= vertical["gain"] <= high, stage
    comparisons = results["mechanism"]["comparisons"]
    assert [(c["question"], c["second"], c["difference"]) for c in summary["mechanism"]] == [
        (c["question"], c["second"], c["difference"]) for c in comparisons
    ]
    text = demo_seeds.table({"seed0": summary, "seed1": None}, {})
    assert "| seed0 | coding |" in text and "Runs missing (not finished): seed1." in text
    first = comparisons[0]
    assert f"| {first['question']} |" in text
    assert (
        f"{first['difference']:+.3f} [{first['interval'][0]:+.3f}, {first['interval'][1]:+.3f}] vs {first['second']}"
        in text
    )


def test_resume_reuses_the_evaluation_of_unchanged_models(quick_demo, tmp_path):
    """--resume keeps each model's scores when its weights, the prompts, the rewards and the settings are the same
    (the merges are written again, byte-identical); a file computed for other inputs is scored again, and a run
    without --resume scores everything (its evaluation phase, on the base and the agents)."""
    import shutil

    from ram_trl.recipes import DEMO_RECIPE, QUICK_OVERRIDES
    from ram_trl.recipes.reuse import EVALUATION_KEY
    from ram_trl.recipes.runner import Run
    from ram_trl.recipes.schema import load_recipe

    out = tmp_path / "run"
    shutil.copytree(quick_demo, out)
    before = json.loads((quick_demo / "results.json").read_text())
    files = sorted((out / "eval").glob("*.json"))
    assert len(files) == len(before["rows"]) and all(EVALUATION_KEY in json.loads(f.read_text()) for f in files)
    stale = out / "eval" / "ties.json"
    tampered = json.loads(stale.read_text())
    tampered[EVALUATION_KEY] = "0" * 64
    stale.write_text(json.dumps(tampered))
    times = {f.name: f.stat().st_mtime_ns for f in files}
    again = run_recipe(DEMO_RECIPE, RunOptions(out=out, resume=True, progress=False, overrides=QUICK_OVERRIDES))
    changed = sorted(f.name for f in files if f.stat().st_mtime_ns != times[f.name])
    assert changed == ["ties.json"]
    assert json.loads(stale.read_text())[EVALUATION_KEY] != "0" * 64
    assert [r["scores"] for r in again["rows"]] == [r["scores"] for r in before["rows"]]
    times = {f.name: f.stat().st_mtime_ns for f in files}
    recipe, root = load_recipe(DEMO_RECIPE, QUICK_OVERRIDES)
    fresh = Run(recipe, root, out, RunOptions(out=out, progress=False, overrides=QUICK_OVERRIDES))
    scored = fresh.evaluate([])  # the phase as a run without --resume calls it, here on the base and the agents
    assert [r["name"] for r in scored] == ["base", *STAGES]
    rewritten = sorted(f.name for f in files if f.stat().st_mtime_ns != times[f.name])
    assert rewritten == sorted(f"{name}.json" for name in ["base", *STAGES])
    assert [r["scores"] for r in scored] == [r["scores"] for r in before["rows"][:4]]


def test_quick_demo_rows_and_files(quick_demo):
    out = quick_demo
    results = json.loads((out / "results.json").read_text())
    assert results["stages"] == STAGES
    assert [r["name"] for r in results["rows"]] == ["base", *STAGES, *MERGES]
    assert [r["kind"] for r in results["rows"]] == ["base"] + ["agent"] * 3 + ["merge"] * len(MERGES)
    for row in results["rows"]:
        for block in (row, row["val"]):  # test and validation
            assert sorted(block["scores"]) == sorted(STAGES), row["name"]
            assert all(0.0 <= v <= 1.0 for v in block["scores"].values())
            assert block["average"] == pytest.approx(sum(block["scores"].values()) / 3)
            assert all(low <= high for low, high in block["interval"].values())
        assert row["n"] == row["val"]["n"] == {s: 8 for s in STAGES}  # val_size defaults to eval_size
        assert ("retention" in row) == (row["kind"] == "merge")
    assert sorted(results["regime"]) == sorted(STAGES)
    assert results["selection"]["ship"] in MERGES and "Ship " in results["verdict"]  # after a smoke preface
    assert [s["label"] for s in results["selection"]["sweeps"]] == ["ram_plus", "task_arithmetic"]
    markdown = (out / "results.md").read_text()
    for name in ["base", *STAGES, *MERGES]:
        assert f"| {name} | " in markdown
    assert markdown.rstrip().endswith(results["verdict"])
    # the demo lists every mechanism merge (issue 32): each question is measured, none asks for a missing row
    assert "## Mechanism: does the unique region at full strength matter?" in markdown
    assert "To measure what is missing" not in markdown and "not measured" not in markdown
    assert sorted(results["mechanism"]["unique"]) == sorted(STAGES)
    # lambda: matched is resolved after RAM: task arithmetic at RAM's L2 norm (the delta is linear in lambda)
    rows = {r["name"]: r for r in results["rows"]}
    assert results["mechanism"]["ta_matched"] == "ta_matched"
    assert rows["ta_matched"]["parameters"]["lambda"] == pytest.approx(
        results["mechanism"]["matched_lambda"], rel=1e-5
    )
    assert rows["ta_matched"]["effect"]["delta_norm"] == pytest.approx(rows["ram"]["effect"]["delta_norm"], rel=1e-5)
    assert results["processes"] == {s: 1 for s in STAGES}
    assert "Trained: coding on 1 process, tools on 1 process, memory on 1 process." in markdown
    for figure in ("scores.png", "retention.png", "training.png", "analysis/density.png"):
        assert (out / figure).read_bytes()[:4] == b"\x89PNG"
    for log in (out / "logs").glob("*.log"):  # a log file gets no progress bars (one line per redraw)
        text = log.read_text()
        assert "Loading weights" not in text and "Writing model shards" not in text, log.name
    # each stage's log history (the telemetry during training) is saved beside its agent and summarized
    assert sorted(results["training"]) == sorted(STAGES)
    for stage in STAGES:
        history = json.loads((out / "stages" / stage / "trainer_state.json").read_text())["log_history"]
        assert [p["step"] for p in results["training"][stage]] == [
            e["step"] for e in history if "task_vector/density" in e
        ]
        assert all(0.0 <= p["density"] <= 1.0 for p in results["training"][stage])
        # each measurement has the reward of the trainer's entry of its step
        assert all(p["reward"] is not None for p in results["training"][stage])
    assert "## During training" in markdown
    for stage in STAGES:  # train, test and validation prompts are disjoint
        prompts = [
            {json.loads(line)["prompt"] for line in (out / "data" / stage / f"{split}.jsonl").read_text().splitlines()}
            for split in ("train", "eval", "val", "warm")
        ]
        assert not prompts[0] & prompts[1] and not prompts[0] & prompts[2] and not prompts[1] & prompts[2]
        assert not prompts[3] & (prompts[1] | prompts[2])
    analysis = json.loads((out / "analysis" / "analysis.json").read_text())
    assert [a["name"] for a in analysis["agents"]] == STAGES
    # the demo's warm start: at least 20 steps on the answers (then 10 more at a time, cap 30), then 10 steps
    # (cap 10) with about half the rows declining, each phase until its criterion holds on the check rows
    record = json.loads((out / "base" / "ram_warm_start.json").read_text())
    acceptance = record["acceptance"]
    answers, abstain = acceptance["phases"]["answers"], acceptance["phases"]["abstain"]
    assert answers["steps"] in (20, 30) and abstain["steps"] == 10
    assert record["steps"] == answers["steps"] + abstain["steps"]
    assert acceptance["accepted"] == (answers["met"] and abstain["met"])
    assert acceptance["check_rows"] == {s: 4 for s in STAGES}
    assert results["warm_start"]["accepted"] == acceptance["accepted"]
    assert "## Warm start" in markdown and f"Criterion: {acceptance['criterion']}." in markdown
    assert record["spec"]["abstain_reply"] == "(I don't know)"
    assert 0.3 * record["rows"] < record["abstaining_rows"] < 0.7 * record["rows"]
    for stage in STAGES:  # the check rows: no stage trains, tests or validates on them, nor does the warm start
        check = {
            json.loads(line)["prompt"] for line in (out / "data" / stage / "check.jsonl").read_text().splitlines()
        }
        assert len(check) == 4
        others = [(out / "data" / stage / f"{split}.jsonl").read_text() for split in ("train", "eval", "val", "warm")]
        assert not check & {json.loads(line)["prompt"] for text in others for line in text.splitlines()}
    for agent in analysis["agents"]:
        assert results["regime"][agent["name"]]["density"] == agent["density"]


def test_quick_demo_agents_are_bf16_stages_with_manifests(quick_demo):
    out = quick_demo
    base_fingerprint = fingerprint_checkpoint(out / "base")
    for name in STAGES:
        stage_dir = out / "stages" / name
        assert stage_complete(stage_dir)
        manifest = read_manifest(stage_dir)
        assert (manifest.stage, manifest.kind, manifest.save_dtype, manifest.trainer) == (
            name, "full", "bfloat16", "GRPOTrainer",
        )  # fmt: skip
        assert manifest.steps == 2
        assert manifest.processes == 1
        assert manifest.base_fingerprint == base_fingerprint
        with safe_open(str(stage_dir / "model.safetensors"), framework="pt") as handle:
            assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}  # noqa: SIM118
        assert (out / "logs" / f"{name}.log").is_file()
    with safe_open(str(out / "base" / "model.safetensors"), framework="pt") as handle:
        assert {handle.get_slice(k).get_dtype() for k in handle.keys()} == {"BF16"}  # noqa: SIM118


def test_quick_demo_merges_load_and_eval_reproduces_the_table(quick_demo, capsys):
    from transformers import AutoModelForCausalLM

    out = quick_demo
    results = json.loads((out / "results.json").read_text())
    for row in results["rows"][4:]:
        model = AutoModelForCausalLM.from_pretrained(row["path"], dtype=torch.float32)
        assert model.config.vocab_size == 100
        report = json.loads((Path(row["path"]) / "ram_merge_report.json").read_text())
        assert report["merge_method"] == row["method"]
        assert [a["name"] for a in report["agents"]] == STAGES
        # recipe merges are written (and scored) in float32, and the row keeps what survives that dtype
        assert report["output"]["dtype"] == "float32" and row["effect"] == report["effect"]
        # the digest of the files scored, so that equal rewards can be told apart from equal weights
        assert row["model_sha256"] == model_digest(row["path"])
    assert len({row["model_sha256"] for row in results["rows"]}) == len(results["rows"])
    # `ram-trl eval` on the run's recipe reproduces the scores of the table exactly (same prompts, greedy, seeded).
    for row in (results["rows"][0], results["rows"][5]):
        json_out = out / f"eval_{row['kind']}.json"
        assert main(["eval", row["path"], "--recipe", str(out / "recipe.yaml"), "--json", str(json_out)]) == 0
        scored = json.loads(json_out.read_text())
        assert scored["scores"] == row["scores"]
        assert scored["splits"]["val"]["scores"] == row["val"]["scores"]
        assert scored["rewards"] == row["rewards"] and scored["splits"]["val"]["rewards"] == row["val"]["rewards"]
    json_out = out / "eval_val.json"
    row = results["rows"][4]
    assert (
        main(["eval", row["path"], "--recipe", str(out / "recipe.yaml"), "--split", "val", "--json", str(json_out)])
        == 0
    )
    scored = json.loads(json_out.read_text())
    assert list(scored["splits"]) == ["val"] and scored["splits"]["val"]["scores"] == row["val"]["scores"]
    assert main(["eval", results["rows"][1]["path"], "--recipe", str(out / "recipe.yaml"), "--stage", "tools"]) == 0
    assert "tools" in capsys.readouterr().out


def _recipe(reward: str) -> dict:
    stage = {
        "prompts": {"generator": "ram_trl.recipes.tasks:recall_prompts", "train_size": 8, "eval_size": 4,
                    "kwargs": {"num_pairs": 2}},
        "config": {"max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 4,
                   "max_completion_length": 4, "disable_tqdm": True},
    }  # fmt: skip
    return {
        "name": "two-stages",
        "torch_threads": 1,
        "base": {"build": {"hidden_size": 16, "num_layers": 1, "intermediate_size": 32}},
        "warm_start": {"steps": 2, "batch_size": 4},
        "stages": [
            # launched through `accelerate launch` (one CPU process): the path a recipe's accelerate config takes
            {
                "name": "good",
                **stage,
                "rewards": ["ram_trl.recipes.tasks:recall_reward"],
                "accelerate_config": "accelerate_cpu.yaml",
            },
            # a LoRA stage: the callback saves the adapter, the merge and the evaluation read it on the base
            {
                "name": "bad",
                **stage,
                "rewards": [reward],
                "peft": {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "v_proj"]},
            },
        ],
        "merges": ["ram"],
        "evaluation": {"max_new_tokens": 2},
    }


def test_failing_stage_names_itself_keeps_earlier_stages_and_resume_skips_them(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_recipe("tests.recipes.failing:batch_failing_reward")))
    (tmp_path / "accelerate_cpu.yaml").write_text(
        yaml.safe_dump(
            {
                "compute_environment": "LOCAL_MACHINE",
                "distributed_type": "NO",
                "num_processes": 1,
                "num_machines": 1,
                "machine_rank": 0,
                "mixed_precision": "no",
                "use_cpu": True,
            }
        )
    )
    out = tmp_path / "run"
    with pytest.raises(StageError) as info:
        run_recipe(recipe, RunOptions(out=out, progress=False))
    message = str(info.value)
    assert message.startswith("stage 'bad' failed (exit code 1): ")
    assert "reward function tests.recipes.failing:batch_failing_reward raised ValueError('boom" in message
    assert f"log: {out / 'logs' / 'bad.log'}" in message
    assert "finished stages kept: good" in message
    assert stage_complete(out / "stages" / "good")
    assert "-m accelerate.commands.launch --config_file " in (out / "logs" / "good.log").read_text()
    assert not stage_complete(out / "stages" / "bad")
    assert not (out / "stages" / "bad").exists()  # the failed stage's temporary directory was removed
    assert leftovers(out / "stages" / "bad") == []
    assert not (out / "results.json").exists()
    # the leftover of a runner killed with kill -9 mid-stage: removed by the next run of the stage
    killed = out / "stages" / f".bad.ram-trl-tmp-{dead_pid()}-0123abcd"
    killed.mkdir()
    (killed / LOCK_FILE).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    (killed / "model.safetensors").write_bytes(b"half")
    good_manifest = (out / "stages" / "good" / "ram_stage.json").stat().st_mtime_ns
    good_weights = (out / "stages" / "good" / "model.safetensors").read_bytes()

    recipe.write_text(yaml.safe_dump(_recipe("ram_trl.recipes.tasks:recall_reward")))
    capsys.readouterr()
    results = run_recipe(recipe, RunOptions(out=out, resume=True, progress=False))
    # progress in a log file: lines (a stage's steps, each merge, each model's evaluation), no bar redrawn
    err = capsys.readouterr().err
    assert "stage bad: step 1/1 (" in err and "stage bad: done in " in err and " on 1 process -> " in err
    assert "merges 1/1: ram (" in err
    assert [line.split(" (")[0] for line in err.splitlines() if line.startswith("evaluation ")] == [
        "evaluation 1/4: base", "evaluation 2/4: good", "evaluation 3/4: bad", "evaluation 4/4: ram"
    ]  # fmt: skip
    assert "\r" not in err and "\r" not in (out / "logs" / "bad.log").read_text()
    assert (out / "stages" / "good" / "ram_stage.json").stat().st_mtime_ns == good_manifest
    assert (out / "stages" / "good" / "model.safetensors").read_bytes() == good_weights
    assert "stage:good" not in results["timings"] and "stage:bad" in results["timings"]
    assert stage_complete(out / "stages" / "bad")
    assert not killed.exists() and leftovers(out / "stages" / "bad") == []
    assert not (out / "stages" / "bad" / LOCK_FILE).exists()
    assert read_manifest(out / "stages" / "bad").kind == "lora"
    assert (out / "stages" / "bad" / "adapter_config.json").is_file()
    assert [r["name"] for r in results["rows"]] == ["base", "good", "bad", "ram"]
    assert [r["kind"] for r in results["rows"]] == ["base", "agent", "agent", "merge"]
    assert all(sorted(r["scores"]) == ["bad", "good"] for r in results["rows"])
    # the second stage was told about the first: its prior_stages (the callback's input) is good's manifest
    assert "--prior " + str(out / "stages" / "good" / "ram_stage.json") in (out / "logs" / "bad.log").read_text()
    # --resume over a finished stage whose recipe entry changed since it trained: refused, naming the field
    changed = _recipe("ram_trl.recipes.tasks:recall_reward")
    changed["stages"][0]["config"]["learning_rate"] = 1e-3
    recipe.write_text(yaml.safe_dump(changed))
    with pytest.raises(
        ConfigError, match=r"stage 'good' .* another config .*stage\.config\.learning_rate: None -> 0\.001"
    ):
        run_recipe(recipe, RunOptions(out=out, resume=True, progress=False))
    assert (out / "stages" / "good" / "model.safetensors").read_bytes() == good_weights


def test_seeds_run_the_pipeline_per_seed_and_report_t_intervals(tmp_path):
    recipe = _recipe("ram_trl.recipes.tasks:recall_reward")
    for stage in recipe["stages"]:
        stage.pop("accelerate_config", None)
        stage.pop("peft", None)
    recipe["merges"] = ["ram", {"method": "dare_linear", "parameters": {"density": 0.5, "lambda": 0.5}}]
    recipe["analysis"] = {"enabled": False}
    out = tmp_path / "run"
    results = run_recipe(recipe, RunOptions(out=out, progress=False, figures=False, seeds=2))
    assert results["statistics"]["intervals"] == "seeds" and results["statistics"]["seed_values"] == [0, 1]
    runs = [json.loads((out / f"seed_{s}" / "results.json").read_text()) for s in (0, 1)]
    assert yaml.safe_load((out / "seed_1" / "recipe.yaml").read_text())["seed"] == 1
    # the base was warm-started once: the same weights in both runs
    assert (out / "seed_0" / "base" / "model.safetensors").read_bytes() == (
        out / "seed_1" / "base" / "model.safetensors"
    ).read_bytes()
    for i, row in enumerate(results["rows"]):
        per_seed = [run["rows"][i] for run in runs]
        assert row["per_seed"] == {s: [r["scores"][s] for r in per_seed] for s in ("good", "bad")}
        assert row["scores"]["good"] == pytest.approx(sum(r["scores"]["good"] for r in per_seed) / 2)
        assert row["val"]["scores"]["bad"] == pytest.approx(sum(r["val"]["scores"]["bad"] for r in per_seed) / 2)
    assert "over 2 seeds" in (out / "results.md").read_text()
    assert json.loads((out / "results.json").read_text())["selection"]["ship"] in ("ram", "dare_linear")


def test_preview_stage_keeps_its_step_and_the_recipe_merge_reproduces_it(tmp_path, monkeypatch):
    """A stage with ``preview:`` merges itself with the earlier stage while it trains; the recipe's own merge of
    the two manifests, scored by the recipe's evaluation, is the logged preview at the kept step to the last digit,
    and results.md reports the step kept with its figure."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    recipe = _recipe("tests.helpers:distinct_chars")  # a reward the tiny model varies on: the weights move
    for stage in recipe["stages"]:
        stage.pop("accelerate_config", None)
        stage.pop("peft", None)
        stage["rewards"] = ["tests.helpers:distinct_chars"]
        stage["prompts"]["val_size"] = 4
        stage["config"]["learning_rate"] = 1e-2  # task vectors that survive the bf16 save
    recipe["stages"][1]["config"]["max_steps"] = 3
    recipe["stages"][1]["preview"] = {"every": 1}
    recipe["merges"] = ["ram_plus"]
    recipe["analysis"] = {"enabled": False}
    out = tmp_path / "run"
    results = run_recipe(recipe, RunOptions(out=out, progress=False))
    record = read_manifest(out / "stages" / "bad").extra["preview"]
    assert [h["step"] for h in record["history"]] == [1, 2, 3]
    averages = [h["average"] for h in record["history"]]
    assert record["kept_step"] == record["history"][averages.index(max(averages))]["step"]
    assert record["stages"] == ["good", "bad"] and record["method"] == "ram_plus"
    kept = record["history"][record["kept_step"] - 1]
    merge_row = next(r for r in results["rows"] if r["name"] == "ram_plus")
    assert merge_row["val"]["scores"] == kept["scores"]
    agent_row = next(r for r in results["rows"] if r["name"] == "bad")
    assert agent_row["val"]["scores"]["bad"] == kept["agent_score"]
    text = (out / "results.md").read_text()
    assert "## Merge preview while training" in text
    assert f"| bad | ram_plus | 3 | {record['kept_step']} of 3 |" in text
    assert (out / "preview-bad.png").is_file() and "![preview-bad](preview-bad.png)" in text
    assert "--val good=" in (out / "logs" / "bad.log").read_text()
    assert all(read_manifest(out / "stages" / s).telemetry["task_vector/density_saved"] > 0 for s in ("good", "bad"))


@pytest.mark.parametrize("method", ["fisher", "fisher_merging"])
def test_fisher_rows_estimate_fisher_whatever_the_method_is_called(tmp_path, method):
    """A merge row of the Fisher method, named or aliased, makes the run estimate the Fisher of every agent first:
    an existing agent without ``fisher.safetensors`` is refused before any merge; other methods need nothing."""
    from ram_trl.errors import ConfigError
    from ram_trl.recipes.runner import Run
    from ram_trl.recipes.schema import expand_merges, load_recipe
    from tests.helpers import base_tensors, recipe_dict, save_checkpoint

    agent = save_checkpoint(tmp_path / "agent", base_tensors())
    data = recipe_dict(stages=[{"name": "coding", "checkpoint": str(agent)}], merges=[method, "ties"])
    recipe, root = load_recipe(data)
    run = Run(recipe, root, tmp_path / "run", RunOptions(progress=False))
    rows = expand_merges(recipe)
    run.fisher([row for row in rows if row.method == "ties"])  # nothing to estimate
    with pytest.raises(ConfigError, match=f"the fisher merge needs {agent}/fisher.safetensors"):
        run.fisher(rows)
