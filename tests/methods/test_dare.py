"""DARE: the hashed random stream (pinned), drop rate, rescale, and independence from chunking."""

from __future__ import annotations

import torch

from ram_trl.methods.dare import dare_drop, dare_key, hashed_uniform


def test_stream_is_pinned():
    # Golden values: changing the hash changes every DARE merge ever made with ram_trl; keep them stable.
    key = dare_key(0, "model.layers.0.mlp.up_proj.weight", 1)
    values = hashed_uniform(key, 0, 4)
    assert values.dtype == torch.float32
    assert values.tolist() == PINNED


PINNED = [0.7682281136512756, 0.2135879397392273, 0.68763667345047, 0.8886240124702454]


def test_stream_statistics():
    u = hashed_uniform(dare_key(7, "w", 0), 0, 200_000)
    assert float(u.min()) >= 0.0 and float(u.max()) < 1.0
    assert abs(float(u.mean()) - 0.5) < 0.005
    assert abs(float((u < 0.1).float().mean()) - 0.1) < 0.005
    # different tensors and agents get different streams
    other = hashed_uniform(dare_key(7, "w", 1), 0, 200_000)
    assert abs(float(((u < 0.5) == (other < 0.5)).float().mean()) - 0.5) < 0.01


def test_chunks_reproduce_the_whole_stream():
    key = dare_key(3, "x", 2)
    whole = hashed_uniform(key, 0, 1000)
    parts = torch.cat([hashed_uniform(key, 0, 123), hashed_uniform(key, 123, 500), hashed_uniform(key, 623, 377)])
    assert torch.equal(whole, parts)


def test_large_offsets_use_high_bits():
    key = dare_key(0, "big", 0)
    low = hashed_uniform(key, 5, 3)
    high = hashed_uniform(key, 5 + 2**32, 3)
    assert not torch.equal(low, high)


def test_drop_and_rescale():
    delta = torch.ones(100_000)
    key = dare_key(0, "t", 0)
    kept = dare_drop(delta.clone(), 0.25, key, 0)
    survivors = kept != 0
    assert abs(float(survivors.float().mean()) - 0.25) < 0.01
    assert torch.all(kept[survivors] == 4.0)  # 1 / (1 - p) with p = 0.75
    assert torch.equal(survivors, hashed_uniform(key, 0, 100_000) < 0.25)
    plain = dare_drop(delta.clone(), 0.25, key, 0, rescale=False)
    assert torch.all(plain[survivors] == 1.0)
    assert torch.equal(dare_drop(delta.clone(), 1.0, key, 0), delta)
    assert torch.count_nonzero(dare_drop(delta.clone(), 0.0, key, 0)) == 0
