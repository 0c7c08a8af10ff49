"""ram_trl.io.checkpoint: which layouts open, what they hold, how rows are read, and how bad inputs are named.

Inputs are the tiny float32 checkpoints of ``tests/helpers.py`` (an embedding [16, 8], an MLP matrix [24, 8] and
its bias [24], a matrix [8, 24]; 2144 bytes of tensors).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from ram_trl.errors import CheckpointError
from ram_trl.io.checkpoint import FISHER_FILE, confine, open_checkpoint, write_chat_template
from ram_trl.io.model_dir import SAFE_INDEX
from ram_trl.io.safetensors_io import RowReader
from tests.helpers import BIAS, DOWN, EMBED, UP, base_tensors, save_checkpoint

SHAPES = {EMBED: (16, 8), UP: (24, 8), BIAS: (24,), DOWN: (8, 24)}


def _shard(root, tensors):
    """``tensors`` as two shards and an index: embedding and bias in the first file, the matrices in the second."""
    root.mkdir()
    parts = {
        "model-00001-of-00002.safetensors": {EMBED: tensors[EMBED], BIAS: tensors[BIAS]},
        "model-00002-of-00002.safetensors": {UP: tensors[UP], DOWN: tensors[DOWN]},
    }
    weight_map = {}
    for file, part in parts.items():
        save_file(part, str(root / file))
        weight_map |= dict.fromkeys(part, file)
    (root / SAFE_INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return root


@pytest.mark.parametrize("layout", ["single", "file", "sharded", "unnamed"])
def test_layouts_open_with_the_same_tensors_and_rows(tmp_path, layout):
    tensors = base_tensors()
    if layout in ("single", "file"):
        path = save_checkpoint(tmp_path / "ckpt", tensors)
        if layout == "file":
            path = path / "model.safetensors"
    elif layout == "sharded":
        path = _shard(tmp_path / "ckpt", tensors)
    else:  # safetensors files under other names, and a Fisher file that is never a weight file
        path = tmp_path / "ckpt"
        path.mkdir()
        save_file({EMBED: tensors[EMBED], BIAS: tensors[BIAS]}, str(path / "a.safetensors"))
        save_file({UP: tensors[UP], DOWN: tensors[DOWN]}, str(path / "b.safetensors"))
        save_file({"x": torch.ones(3)}, str(path / FISHER_FILE))
    ckpt = open_checkpoint(path, "agent 0")
    assert ckpt.kind == "full" and ckpt.format == "safetensors" and ckpt.role == "agent 0"
    assert {n: m.shape for n, m in ckpt.tensors.items()} == SHAPES
    assert all(m.dtype == torch.float32 for m in ckpt.tensors.values())
    assert ckpt.total_bytes == 2144
    assert len(ckpt.files) == (1 if layout in ("single", "file") else 2)
    assert all(ckpt.has_values(n) for n in SHAPES) and not ckpt.has_values("missing")
    assert ckpt.lora_delta_rows(UP, None, 0, 1) is None
    with RowReader() as reader:
        assert torch.equal(ckpt.read_rows(EMBED, reader), tensors[EMBED])
        assert torch.equal(ckpt.read_rows(UP, reader, 5, 9), tensors[UP][5:9])
        assert torch.equal(ckpt.read_rows(BIAS, reader, 20, 24), tensors[BIAS][20:])
    info = ckpt.location(DOWN)
    assert info.end - info.begin == 8 * 24 * 4


def test_config_path(tmp_path):
    with_config = open_checkpoint(save_checkpoint(tmp_path / "a", base_tensors()), "base model")
    assert with_config.config_path == tmp_path / "a" / "config.json"
    path = tmp_path / "b"
    path.mkdir()
    save_file(base_tensors(), str(path / "model.safetensors"))
    assert open_checkpoint(path, "base model").config_path is None


def test_bf16_tensors_keep_their_stored_dtype(tmp_path):
    tensors = {n: v.to(torch.bfloat16) for n, v in base_tensors().items()}
    ckpt = open_checkpoint(save_checkpoint(tmp_path / "bf16", tensors), "base model")
    assert {m.dtype for m in ckpt.tensors.values()} == {torch.bfloat16}
    assert ckpt.total_bytes == 1072
    with RowReader() as reader:
        rows = ckpt.read_rows(UP, reader, 0, 2)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, tensors[UP][:2])


def test_pickle_checkpoints_need_allow_pickle(tmp_path):
    tensors = base_tensors()
    path = tmp_path / "pickled"
    path.mkdir()
    torch.save(tensors, path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"agent 1: .* holds only pickle checkpoints.*--allow-pickle"):
        open_checkpoint(path, "agent 1")
    with pytest.warns(UserWarning, match="loading pickle checkpoint"):
        ckpt = open_checkpoint(path, "agent 1", allow_pickle=True)
    assert ckpt.format == "pickle" and ckpt.location(UP) is None and ckpt.total_bytes == 0
    assert {n: m.shape for n, m in ckpt.tensors.items()} == SHAPES
    assert torch.equal(ckpt.read_rows(DOWN, None, 2, 5), tensors[DOWN][2:5])


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", r"agent 2: .*/nothing does not exist \(not a local path, nor a Hub id ORG/NAME\)"),
        ("text_file", r"agent 2: .*notes.txt is a file but not a .safetensors file"),
        ("empty_dir", r"agent 2: .* is not a checkpoint directory"),
        ("bad_index", rf"agent 2: safetensors index .*{SAFE_INDEX}: not valid JSON"),
        ("missing_shard", rf"agent 2: shard .*model-00002-of-00002.safetensors listed in {SAFE_INDEX} is missing"),
        ("wrong_shard", rf"agent 2: {SAFE_INDEX} maps tensor '{UP}' to .*, which does not hold it"),
        ("duplicate", rf"agent 2: tensor '{UP}' appears in both .*a.safetensors and .*b.safetensors"),
    ],
)
def test_bad_inputs_name_the_role_and_the_path(tmp_path, setup, message):
    tensors = base_tensors()
    path = tmp_path / "nothing"
    if setup == "text_file":
        path = tmp_path / "notes.txt"
        path.write_text("not a model")
    elif setup == "empty_dir":
        path.mkdir()
    elif setup == "bad_index":
        path = _shard(tmp_path / "s", tensors)
        (path / SAFE_INDEX).write_text("{not json")
    elif setup == "missing_shard":
        path = _shard(tmp_path / "s", tensors)
        (path / "model-00002-of-00002.safetensors").unlink()
    elif setup == "wrong_shard":
        path = _shard(tmp_path / "s", tensors)
        index = json.loads((path / SAFE_INDEX).read_text())
        index["weight_map"][UP] = "model-00001-of-00002.safetensors"
        (path / SAFE_INDEX).write_text(json.dumps(index))
    elif setup == "duplicate":
        path.mkdir()
        save_file({UP: tensors[UP]}, str(path / "a.safetensors"))
        save_file({UP: tensors[UP], DOWN: tensors[DOWN]}, str(path / "b.safetensors"))
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(path, "agent 2")


def test_write_chat_template_replaces_every_copy_of_the_old_one(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "old", "eos_token": "</s>"}))
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "old"}))
    write_chat_template(tmp_path, "{{ messages }}")
    assert (tmp_path / "chat_template.jinja").read_text() == "{{ messages }}"
    assert not (tmp_path / "chat_template.json").exists()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"eos_token": "</s>"}


def test_confine(tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    inside = root / "model-00001.safetensors"
    assert confine(inside, root, "index") == inside
    outside = tmp_path / "elsewhere.safetensors"
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        confine(outside, root, "index")
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        confine(root / ".." / "elsewhere.safetensors", root, "index")
    assert confine(outside, root, "index", allow_external=True) == outside
    link = root / "link.safetensors"
    os.symlink(outside, link)
    with pytest.raises(CheckpointError, match=f"which resolves to {outside}"):
        confine(link, root, "index")
