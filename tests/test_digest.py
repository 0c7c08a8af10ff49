"""The one digest module: the values stored in manifests, records and reports, and its bounded cache."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from safetensors.torch import save_file

from ram_trl import digest
from ram_trl.digest import file_digest, key_bytes, text_digest, weights_digest


@pytest.mark.parametrize("size", [0, 1, 4095, (1 << 24) + 3])
def test_file_digest_is_the_sha256_of_the_bytes_on_disk(tmp_path, size):
    file = tmp_path / "model.safetensors"
    file.write_bytes(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(size)).byte().numpy())
    assert file_digest(file) == hashlib.sha256(file.read_bytes()).hexdigest()


def test_a_rewritten_file_is_hashed_again(tmp_path):
    file = tmp_path / "a.bin"
    file.write_bytes(b"first")
    assert file_digest(file) == hashlib.sha256(b"first").hexdigest()
    file.write_bytes(b"other")  # same size, same inode
    os.utime(file, ns=(1, 1))
    assert file_digest(file) == hashlib.sha256(b"other").hexdigest()


def test_the_cache_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(digest, "CACHE_ENTRIES", 3)
    monkeypatch.setattr(digest, "_cache", type(digest._cache)())
    files = [tmp_path / f"{i}.bin" for i in range(5)]
    for i, file in enumerate(files):
        file.write_bytes(bytes([i]))
        assert file_digest(file) == hashlib.sha256(bytes([i])).hexdigest()
    assert len(digest._cache) == 3
    assert [key[1] for key in digest._cache] == [str(f.resolve()) for f in files[2:]]  # the least recent left


def test_weights_digest_is_the_documented_scheme(tmp_path):
    """Name order, ``name|dtype|shape|`` then the raw bytes: the value stored as ``merged_sha256``/``agent_sha256``
    by earlier previews."""
    tensors = {"b": torch.ones(4, dtype=torch.bfloat16), "a": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    expected = hashlib.sha256()
    expected.update(b"a|float32|[2, 3]|" + tensors["a"].numpy().tobytes())
    expected.update(b"b|bfloat16|[4]|" + tensors["b"].view(torch.int16).numpy().tobytes())
    assert weights_digest(tmp_path) == expected.hexdigest()


def test_weights_digest_ignores_sharding_and_sees_one_bit(tmp_path):
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4, dtype=torch.bfloat16)}
    whole, sharded, changed = tmp_path / "whole", tmp_path / "sharded", tmp_path / "changed"
    for d in (whole, sharded, changed):
        d.mkdir()
    save_file(tensors, str(whole / "model.safetensors"))
    save_file({"b": tensors["b"]}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"a": tensors["a"]}, str(sharded / "model-00002-of-00002.safetensors"))
    flipped = tensors["a"].clone()
    flipped.view(torch.int32)[0, 1] ^= 1  # one bit of one element
    save_file({"a": flipped, "b": tensors["b"]}, str(changed / "model.safetensors"))
    assert weights_digest(whole) == weights_digest(sharded)
    assert weights_digest(whole) != weights_digest(changed)
    save_file({"a": flipped, "b": tensors["b"]}, str(whole / "model.safetensors"))  # rewritten in place
    assert weights_digest(whole) == weights_digest(changed)


def test_text_and_key_digests_keep_their_values():
    assert text_digest("ab") == hashlib.sha256(b"ab").hexdigest() == text_digest(b"ab")
    assert key_bytes("1\x00t\x000") == hashlib.blake2b(b"1\x00t\x000", digest_size=8).digest()
