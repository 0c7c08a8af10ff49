"""ram_trl.recipes.reuse: an evaluation is reused only for the same weights, configuration, base, prompts, reward
source and settings."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from ram_trl.evaluation import EvalTask
from ram_trl.recipes.reuse import EVALUATION_KEY, evaluation_key, model_digest, reusable_evaluation

REWARD = "ram_trl.recipes.tasks:arithmetic_reward"


def _model(path, value: float = 1.0, shards: int = 1):
    path.mkdir(parents=True, exist_ok=True)
    tensors = {"a": torch.full((2, 3), value), "b": torch.arange(4.0)}
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
    else:
        save_file({"a": tensors["a"]}, str(path / "model-00001-of-00002.safetensors"))
        save_file({"b": tensors["b"]}, str(path / "model-00002-of-00002.safetensors"))
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    return path


def test_the_model_digest_follows_weights_and_configuration_not_sharding(tmp_path):
    digest = model_digest(_model(tmp_path / "one"))
    assert model_digest(_model(tmp_path / "sharded", shards=2)) == digest
    assert model_digest(_model(tmp_path / "other", value=2.0)) != digest
    changed = _model(tmp_path / "config")
    (changed / "config.json").write_text('{"model_type": "llama"}')
    assert model_digest(changed) != digest
    (changed / "config.json").write_text('{"model_type": "qwen2"}')
    (changed / "chat_template.jinja").write_text("{{ messages }}")
    assert model_digest(changed) != digest


def test_the_key_follows_every_input():
    tasks = [EvalTask("coding", [{"prompt": "1+1=", "answer": "2"}], [REWARD], split="test")]
    key = evaluation_key("m", "b", tasks, {"max_new_tokens": 8})
    assert evaluation_key("m", "b", tasks, {"max_new_tokens": 8}) == key
    assert evaluation_key("m2", "b", tasks, {"max_new_tokens": 8}) != key
    assert evaluation_key("m", "b2", tasks, {"max_new_tokens": 8}) != key
    assert evaluation_key("m", "b", tasks, {"max_new_tokens": 9}) != key
    other_rows = [EvalTask("coding", [{"prompt": "1+2=", "answer": "3"}], [REWARD], split="test")]
    assert evaluation_key("m", "b", other_rows, {"max_new_tokens": 8}) != key
    other_reward = [EvalTask("coding", tasks[0].rows, ["ram_trl.recipes.tasks:recall_reward"], split="test")]
    assert evaluation_key("m", "b", other_reward, {"max_new_tokens": 8}) != key


def test_an_evaluation_file_is_reused_only_for_its_key(tmp_path):
    file = tmp_path / "eval.json"
    assert reusable_evaluation(file, "k") is None  # missing
    file.write_text("{not json")
    assert reusable_evaluation(file, "k") is None
    file.write_text(json.dumps({"scores": {}, "splits": {}}))  # an older file without a key
    assert reusable_evaluation(file, "k") is None
    file.write_text(json.dumps({"scores": {"a": 1.0}, "splits": {}, EVALUATION_KEY: "k"}))
    assert reusable_evaluation(file, "other") is None
    assert reusable_evaluation(file, "k")["scores"] == {"a": 1.0}
