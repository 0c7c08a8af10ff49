"""ram_trl.recipes.reuse: an evaluation is reused only for the same weights, configuration, base, prompts, reward
source and settings."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.evaluation import EvalTask
from ram_trl.recipes.reuse import EVALUATION_KEY, evaluation_key, model_digest, reusable_evaluation, reward_digests

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


# ---------------------------------------------------------------------------------------------------------------
# the key follows every tokenizer and generation file, and the reward's whole code closure (issue 34)

LOADER_FILES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
)


@pytest.mark.parametrize("name", LOADER_FILES)
def test_the_model_digest_follows_every_file_a_loader_reads(tmp_path, name):
    model = _model(tmp_path / "m")
    (model / name).write_text("one")
    digest = model_digest(model)
    (model / name).write_text("two")
    assert model_digest(model) != digest


def test_the_model_digest_leaves_out_records_and_cards(tmp_path):
    model = _model(tmp_path / "m")
    digest = model_digest(model)
    (model / "ram_merge_report.json").write_text('{"created": "now"}')
    (model / "README.md").write_text("a model card")
    assert model_digest(model) == digest


def _package(tmp_path, monkeypatch, files: dict[str, str]) -> dict[str, object]:
    """Modules written under ``tmp_path`` (importable; removed from ``sys.modules`` after the test)."""
    root = tmp_path / "code"
    root.mkdir(exist_ok=True)
    for name, text in files.items():
        (root / f"{name}.py").write_text(textwrap.dedent(text))
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.syspath_prepend(str(root))
    return {name: root / f"{name}.py" for name in files}


def _key(path: str) -> str | None:
    tasks = [EvalTask("coding", [{"prompt": "1+1=", "answer": "2"}], [path], split="test")]
    return evaluation_key("m", "b", tasks, {"max_new_tokens": 8})


def test_the_key_follows_a_helper_module_the_reward_imports(tmp_path, monkeypatch):
    files = _package(
        tmp_path,
        monkeypatch,
        {
            "i34_reward": "from i34_helper import score\ndef reward(completions, **kw):\n    return score(completions)\n",
            "i34_helper": "import i34_deep\ndef score(c):\n    return [0.0 for _ in c]\n",
            "i34_deep": "X = 1\n",
        },
    )
    key = _key("i34_reward:reward")
    assert key is not None and _key("i34_reward:reward") == key
    files["i34_helper"].write_text(files["i34_helper"].read_text().replace("0.0", "1.0"))
    changed = _key("i34_reward:reward")
    assert changed != key
    files["i34_deep"].write_text("X = 2\n")  # transitively imported
    assert _key("i34_reward:reward") != changed


def test_the_key_follows_a_callable_objects_class(tmp_path, monkeypatch):
    files = _package(
        tmp_path,
        monkeypatch,
        {
            "i34_obj": "from i34_cls import Reward\nreward = Reward()\n",
            "i34_cls": "class Reward:\n    def __call__(self, completions, **kw):\n        return [0.0] * len(completions)\n",
        },
    )
    key = _key("i34_obj:reward")
    assert key is not None
    files["i34_cls"].write_text(files["i34_cls"].read_text().replace("0.0", "1.0"))
    assert _key("i34_obj:reward") != key


def test_the_key_follows_a_decorated_reward_and_its_decorator(tmp_path, monkeypatch):
    files = _package(
        tmp_path,
        monkeypatch,
        {
            "i34_deco": "import functools\ndef clip(fn):\n    @functools.wraps(fn)\n"
            "    def wrapper(*a, **k):\n        return fn(*a, **k)\n    return wrapper\n",
            "i34_decorated": "from i34_deco import clip\n@clip\ndef reward(completions, **kw):\n"
            "    return [0.0] * len(completions)\n",
        },
    )
    key = _key("i34_decorated:reward")
    files["i34_decorated"].write_text(files["i34_decorated"].read_text().replace("0.0", "1.0"))
    changed = _key("i34_decorated:reward")
    assert changed != key
    files["i34_deco"].write_text(files["i34_deco"].read_text().replace("fn(*a, **k)", "fn(*a, **k)[:1]"))
    assert _key("i34_decorated:reward") != changed


def test_the_key_follows_a_partials_function_and_arguments(tmp_path, monkeypatch):
    files = _package(
        tmp_path,
        monkeypatch,
        {
            "i34_partial": "import functools\nfrom i34_base import scaled\nreward = functools.partial(scaled, k=2)\n",
            "i34_base": "def scaled(completions, k, **kw):\n    return [0.0 * k] * len(completions)\n",
        },
    )
    key = _key("i34_partial:reward")
    files["i34_base"].write_text(files["i34_base"].read_text().replace("0.0", "1.0"))
    assert _key("i34_partial:reward") != key


def test_a_reward_that_cannot_be_keyed_is_scored_again(tmp_path, monkeypatch):
    _package(
        tmp_path,
        monkeypatch,
        {
            "i34_opaque": "import functools\nclass Opaque:\n    pass\n"
            "def scaled(completions, k, **kw):\n    return [0.0] * len(completions)\n"
            "reward = functools.partial(scaled, k=Opaque())\n"
        },
    )
    tasks = [EvalTask("coding", [{"prompt": "1+1=", "answer": "2"}], ["i34_opaque:reward"], split="test")]
    digests, reason = reward_digests(tasks)
    assert digests is None and "i34_opaque:reward" in reason and "repr" in reason
    assert _key("i34_opaque:reward") is None
    assert reusable_evaluation(tmp_path / "any.json", None) is None


def test_the_key_follows_library_versions(monkeypatch):
    from ram_trl.recipes import code_digest

    key = _key(REWARD)
    monkeypatch.setattr(code_digest, "library_versions", lambda: {"transformers": "0.0"})
    assert _key(REWARD) != key
