"""Fisher estimation: hand-computed golden cases, an independent autograd check on a tiny Qwen2, the CLI, LoRA."""

from __future__ import annotations

import hashlib
import json
import math
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

import ram_trl
from ram_trl.cli import main
from ram_trl.errors import RamTrlError
from ram_trl.evaluation.fisher import (
    Completion,
    estimate_fisher,
    fisher_from_completions,
    generate_completions,
    load_agent,
    read_prompts,
    save_fisher,
)
from ram_trl.io.checkpoint import FISHER_FILE
from ram_trl.stage.manifest import StageManifest, describe_files, write_manifest
from ram_trl.synthetic import make_agent_set, make_base_checkpoint
from tests import reference
from tests.helpers import cache_repo, offline_cache

PROMPTS = ["12+3=", "call f(x)", "key k7 -> "]


class Bigram(torch.nn.Module):
    """logits[t] = W[token t]: the gradient of log p(y | x) with respect to row W[x] is onehot(y) - softmax(W[x])."""

    def __init__(self, probabilities: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(probabilities.log())

    def forward(self, input_ids):
        return type("Output", (), {"logits": self.table[input_ids]})()


def test_bigram_fisher_by_hand():
    p = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25], [0.5, 0.25, 0.25]], dtype=torch.float64).float()
    model = Bigram(p)
    # sample 1: prompt [2], completion [0, 1]: row 2 predicts 0, then row 0 predicts 1
    # sample 2: prompt [1], completion [1]: row 1 predicts 1
    samples = [Completion(torch.tensor([2]), torch.tensor([0, 1])), Completion(torch.tensor([1]), torch.tensor([1]))]
    fisher = fisher_from_completions(model, samples)["table"]
    g1 = torch.tensor([[-0.25, 0.5, -0.25], [0.0, 0.0, 0.0], [0.5, -0.25, -0.25]])  # onehot - p, per used row
    g2 = torch.tensor([[0.0, 0.0, 0.0], [-0.5, 0.75, -0.25], [0.0, 0.0, 0.0]])
    expected = (g1.square() + g2.square()) / 2
    # [[1/32, 1/8, 1/32], [1/8, 9/32, 1/32], [1/8, 1/32, 1/32]]
    torch.testing.assert_close(fisher, expected, rtol=1e-6, atol=1e-7)
    assert fisher.dtype == torch.float32
    assert model.table.requires_grad and model.training  # restored


def test_repeated_row_gradients_add_before_squaring():
    """Two positions using the same row: the sample's gradient is their sum, squared once (not a sum of squares)."""
    p = torch.full((2, 2), 0.5)
    fisher = fisher_from_completions(Bigram(p), [Completion(torch.tensor([0]), torch.tensor([0, 1]))])["table"]
    # row 0 predicts 0 then (input 0) predicts 1: gradient (0.5, -0.5) + (-0.5, 0.5) = 0
    assert fisher.tolist() == [[0.0, 0.0], [0.0, 0.0]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("fisher_est")
    untied = make_base_checkpoint(
        root / "untied", hidden_size=16, num_layers=1, intermediate_size=32, dtype=torch.float32, seed=3
    )
    tied = make_base_checkpoint(
        root / "tied",
        hidden_size=16,
        num_layers=1,
        intermediate_size=32,
        dtype=torch.float32,
        tie_word_embeddings=True,
        seed=4,
    )
    return root, untied, tied


def _independent_fisher(model, tokenizer, prompts, max_new_tokens):
    """Greedy decoding by argmax and per-sample torch.autograd.grad, written without ram_trl."""
    model.eval()
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    total = None
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"][0]
        sequence = ids.clone()
        with torch.no_grad():
            for _ in range(max_new_tokens):
                token = model(input_ids=sequence.unsqueeze(0)).logits[0, -1].argmax()
                sequence = torch.cat([sequence, token.view(1)])
                if int(token) == tokenizer.eos_token_id:
                    break
        logits = model(input_ids=sequence.unsqueeze(0)).logits[0, len(ids) - 1 : -1].float()
        target = sequence[len(ids) :]
        log_likelihood = torch.log_softmax(logits, -1).gather(-1, target.unsqueeze(-1)).sum()
        grads = torch.autograd.grad(log_likelihood, params, allow_unused=True)
        squares = [torch.zeros_like(p) if g is None else g.float() ** 2 for p, g in zip(params, grads, strict=True)]
        total = squares if total is None else [a + b for a, b in zip(total, squares, strict=True)]
    return {n: t / len(prompts) for n, t in zip(names, total, strict=True)}


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_qwen2_fisher_equals_independent_autograd(tiny, which):
    _, untied, tied = tiny
    path = untied if which == "untied" else tied
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    fisher = estimate_fisher(model, tokenizer, PROMPTS, max_new_tokens=5)
    expected = _independent_fisher(model, tokenizer, PROMPTS, 5)
    assert set(fisher) == set(expected)
    for name, value in expected.items():
        assert torch.equal(fisher[name], value), f"{name}: max diff {(fisher[name] - value).abs().max()}"
    # keyed exactly by the checkpoint's tensor names (a tied lm_head is stored once, as embed_tokens)
    assert set(fisher) == set(load_file(str(path / "model.safetensors")))
    assert ("lm_head.weight" in fisher) == (which == "untied")
    assert all(bool((v >= 0).all()) for v in fisher.values())
    assert sum(float(v.sum()) for v in fisher.values()) > 0


def test_num_samples_and_sampling(tiny):
    _, untied, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(untied)
    first = generate_completions(model, tokenizer, PROMPTS, 2, 4)
    assert len(first) == 2 and torch.equal(
        first[1].prompt_ids, tokenizer(PROMPTS[1], return_tensors="pt")["input_ids"][0]
    )
    with pytest.raises(ValueError, match="greedy decoding would repeat"):
        generate_completions(model, tokenizer, PROMPTS, 4, 4)
    state = torch.random.get_rng_state()
    a = generate_completions(model, tokenizer, PROMPTS, 6, 6, sample=True, seed=1)
    b = generate_completions(model, tokenizer, PROMPTS, 6, 6, sample=True, seed=1)
    c = generate_completions(model, tokenizer, PROMPTS, 6, 6, sample=True, seed=2)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is untouched
    assert all(torch.equal(x.completion_ids, y.completion_ids) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x.completion_ids, y.completion_ids) for x, y in zip(a, c, strict=True))


def test_completion_includes_eos_and_stops_there(tiny):
    _, untied, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(untied)
    free = generate_completions(model, tokenizer, PROMPTS[:1], max_new_tokens=4)[0].completion_ids
    assert free.numel() == 4
    # make the model's second greedy token its end-of-sequence token: the completion ends with it, inclusive
    model.generation_config.eos_token_id = int(free[1])
    stopped = generate_completions(model, tokenizer, PROMPTS[:1], max_new_tokens=4)[0].completion_ids
    first = int((free == free[1]).nonzero()[0])
    assert stopped.tolist() == free[: first + 1].tolist()


def test_peft_model_is_refused(tiny):
    peft = pytest.importorskip("peft")
    _, untied, _ = tiny
    model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(untied)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(RamTrlError, match="merge_and_unload"):
        estimate_fisher(wrapped, tokenizer, PROMPTS, max_new_tokens=2)


def test_save_fisher_is_atomic_and_checks_values(tmp_path):
    agent = tmp_path / "agent"
    agent.mkdir()
    (agent / "model.safetensors").write_bytes(b"weights")
    path = save_fisher({"w": torch.tensor([[0.5, 0.0]], dtype=torch.float64)}, agent, {"num_samples": 3})
    assert path == agent / FISHER_FILE
    assert load_file(str(path))["w"].dtype == torch.float32
    with safe_open(str(path), "pt") as handle:
        assert handle.metadata()["num_samples"] == "3"
    assert sorted(p.name for p in agent.iterdir()) == [FISHER_FILE, "model.safetensors"]
    before = path.read_bytes()
    for bad in (float("nan"), -1.0, math.inf):
        with pytest.raises(RamTrlError, match="'w'"):
            save_fisher({"w": torch.tensor([bad])}, agent)
    assert path.read_bytes() == before  # the old file survives a refused write
    assert sorted(p.name for p in agent.iterdir()) == [FISHER_FILE, "model.safetensors"]
    with pytest.raises(RamTrlError, match="does not exist"):
        save_fisher({"w": torch.ones(1)}, tmp_path / "missing")


def test_read_prompts(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("a b\n\nc\n")
    assert read_prompts(lines) == ["a b", "c"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "x\ny", "answer": 1}) + "\n" + json.dumps({"prompt": "z"}) + "\n")
    assert read_prompts(jsonl) == ["x\ny", "z"]
    jsonl.write_text(json.dumps({"prompt": "x"}) + "\n" + json.dumps({"question": "z"}) + "\n")
    with pytest.raises(RamTrlError, match=r"p.jsonl:2: .*'prompt'"):
        read_prompts(jsonl)
    (tmp_path / "empty.txt").write_text("\n")
    with pytest.raises(RamTrlError, match="no prompts"):
        read_prompts(tmp_path / "empty.txt")


def _digest(directory):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


def test_cli_writes_a_loadable_fisher_and_the_merge_uses_it(tiny, tmp_path, capsys):
    root, untied, _ = tiny
    base = make_base_checkpoint(tmp_path / "base", hidden_size=16, num_layers=1, intermediate_size=32, seed=3)
    agents = make_agent_set(base, tmp_path, densities=(0.1, 0.3), seed=5)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    before = {a: _digest(a) for a in agents}
    for agent in agents:
        assert main(["fisher", str(agent), "--prompts", str(prompts), "--max-new-tokens", "3", "--no-progress"]) == 0
        after = _digest(agent)
        assert set(after) == set(before[agent]) | {FISHER_FILE}
        assert {k: v for k, v in after.items() if k != FISHER_FILE} == before[agent]
    assert "diagonal Fisher" in capsys.readouterr().out
    fishers = [load_file(str(a / FISHER_FILE)) for a in agents]
    base_state = reference.load_state_dict(base)
    assert set(fishers[0]) == set(base_state)
    assert all(fishers[0][n].shape == base_state[n].shape for n in base_state)
    # the CLI's Fisher is estimate_fisher's on the float32-loaded agent
    model, tokenizer = load_agent(agents[0])
    direct = estimate_fisher(model, tokenizer, PROMPTS, max_new_tokens=3)
    assert all(torch.equal(direct[n], fishers[0][n]) for n in direct)
    config = {
        "merge_method": "fisher",
        "base_model": str(base),
        "models": [{"model": str(a)} for a in agents],
        "parameters": {"fisher_floor": 0.0},
    }
    ram_trl.merge(config, tmp_path / "merged", progress=False)
    expected = reference.fisher_reference(
        base_state, [reference.load_state_dict(a) for a in agents], fishers, [1.0, 1.0], floor=0.0
    )
    merged = reference.load_state_dict(tmp_path / "merged")
    assert all(torch.equal(merged[n], v.to(merged[n].dtype)) for n, v in expected.items())
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "merged") is not None


def test_cli_errors(tiny, tmp_path, capsys):
    _, untied, _ = tiny
    assert main(["fisher", str(untied), "--prompts", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err
    prompts = tmp_path / "p.txt"
    prompts.write_text("a\n")
    assert main(["fisher", str(untied), "--prompts", str(prompts), "--num-samples", "3", "--no-progress"]) == 2
    assert "greedy decoding would repeat" in capsys.readouterr().err
    assert not (untied / FISHER_FILE).exists()


def test_lora_agent_fisher_is_keyed_by_base_names_and_merges(tiny, tmp_path):
    peft = pytest.importorskip("peft")
    _, untied, _ = tiny
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    lora = peft.get_peft_model(
        model, peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "down_proj"], init_lora_weights=False)
    )
    lora.save_pretrained(tmp_path / "adapter")
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    config_file = tmp_path / "adapter" / "adapter_config.json"
    adapter_config = json.loads(config_file.read_text())
    assert adapter_config["base_model_name_or_path"] == str(untied)
    adapter_config["base_model_name_or_path"] = str(tmp_path / "moved-away")
    config_file.write_text(json.dumps(adapter_config))
    with pytest.raises(RamTrlError, match="--base"):
        load_agent(tmp_path / "adapter")
    assert main(["fisher", str(tmp_path / "adapter"), "--prompts", str(prompts), "--base", str(untied),
                 "--max-new-tokens", "3", "--no-progress"]) == 0  # fmt: skip
    fisher = load_file(str(tmp_path / "adapter" / FISHER_FILE))
    base_state = load_file(str(untied / "model.safetensors"))
    assert set(fisher) == set(base_state)
    # estimated on the merged-in model
    merged_model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    merged_model = peft.PeftModel.from_pretrained(merged_model, tmp_path / "adapter").merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(untied)
    direct = estimate_fisher(merged_model, tokenizer, PROMPTS, max_new_tokens=3)
    assert all(torch.equal(direct[n], fisher[n]) for n in fisher)
    # Fisher merge of the LoRA agent alone: its dense delta weighted by its own Fisher is itself (F > 0 or the
    # plain mean of one agent): the merged model is the adapter merged in
    config = {
        "merge_method": "fisher",
        "base_model": str(untied),
        "models": [{"model": str(tmp_path / "adapter")}],
        "out_dtype": "float32",
    }
    ram_trl.merge(config, tmp_path / "out", progress=False)
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in merged_model.state_dict().items():
        torch.testing.assert_close(merged[name], value, rtol=1e-6, atol=1e-6, msg=name)


def test_a_lora_stage_finds_its_relative_base_beside_its_manifest(tiny, tmp_path, monkeypatch):
    """eval and fisher load a LoRA stage on the base its manifest names, a relative path read from the manifest's
    directory (not the working directory), before the adapter config's own (moved-away) claim."""
    peft = pytest.importorskip("peft")
    _, untied, _ = tiny
    shutil.copytree(untied, tmp_path / "run" / "base")
    stage = tmp_path / "run" / "stages" / "s"
    model = AutoModelForCausalLM.from_pretrained(untied, dtype=torch.float32)
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    lora.save_pretrained(stage)
    config_file = stage / "adapter_config.json"
    config_file.write_text(
        json.dumps({**json.loads(config_file.read_text()), "base_model_name_or_path": "moved-away"})
    )
    manifest = StageManifest(
        stage="s", base_model="../../base", checkpoint=".", kind="lora", files=describe_files(stage)
    )
    write_manifest(manifest, stage)
    elsewhere = tmp_path / "elsewhere" / "deeper"
    elsewhere.mkdir(parents=True)
    monkeypatch.chdir(elsewhere)  # "../../base" from here does not exist
    loaded, _ = load_agent(stage)
    expected = lora.merge_and_unload().state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in loaded.state_dict().items())


def test_hub_agents_fisher_lies_beside_their_snapshot_and_the_merge_by_id_finds_it(tmp_path, monkeypatch):
    """Agents named by Hub id, resolved from an offline cache: `ram-trl fisher ORG/NAME` writes the Fisher into the
    agent's snapshot (its directory, as for a local agent), the same values as the agent's by path, and a fisher
    merge by ids finds it there and writes the bytes of the same merge by paths."""
    base = make_base_checkpoint(
        tmp_path / "local" / "base", hidden_size=16, num_layers=1, intermediate_size=32, seed=3
    )
    agents = make_agent_set(base, tmp_path / "local", densities=(0.1, 0.3), seed=5)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cache = offline_cache(tmp_path / "cache", monkeypatch)
    cache_repo(cache, "acme/base", base, "a" * 40)
    snapshots = [cache_repo(cache, f"acme/agent{i}", a, str(i + 1) * 40) for i, a in enumerate(agents)]
    for ref in [*(str(a) for a in agents), "acme/agent0", f"acme/agent1@{'2' * 40}"]:
        assert main(["fisher", ref, "--prompts", str(prompts), "--max-new-tokens", "3", "--no-progress"]) == 0
    for agent, snapshot in zip(agents, snapshots, strict=True):
        by_id, by_path = load_file(str(snapshot / FISHER_FILE)), load_file(str(agent / FISHER_FILE))
        assert by_id.keys() == by_path.keys() and all(torch.equal(by_id[n], by_path[n]) for n in by_path)
    with safe_open(str(snapshots[0] / FISHER_FILE), "pt") as handle:
        assert json.loads(handle.metadata()["hub"]) == {"repo_id": "acme/agent0", "revision": "1" * 40}
    with safe_open(str(agents[0] / FISHER_FILE), "pt") as handle:
        assert "hub" not in handle.metadata()
    outputs = []
    for name, refs in (
        ("by_path", [str(base), *map(str, agents)]),
        ("by_id", ["acme/base", "acme/agent0", "acme/agent1"]),
    ):
        config = {"merge_method": "fisher", "base_model": refs[0], "models": [{"model": r} for r in refs[1:]]}
        report = ram_trl.merge(config, tmp_path / name, progress=False)
        outputs.append((tmp_path / name / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]
    assert [a["parameters"]["fisher"] for a in report["agents"]] == [str(s / FISHER_FILE) for s in snapshots]
