"""Our positioned safetensors reader and streaming shard writer against the safetensors library."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from ram_trl.errors import CheckpointError
from ram_trl.io.safetensors_io import PlannedTensor, RowReader, ShardFile, read_safetensors_header

TENSORS = {
    "matrix": torch.randn(7, 5).to(torch.bfloat16),
    "bias": torch.randn(5),
    "scalar": torch.tensor(3.5, dtype=torch.float16),
    "ids": torch.arange(6, dtype=torch.int64).reshape(2, 3),
    "cube": torch.randn(3, 2, 4, dtype=torch.float64),
    "empty": torch.zeros(0, 4),
}


@pytest.fixture
def file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_file(TENSORS, str(path), metadata={"format": "pt"})
    return path


def test_header_and_rows_match_safetensors(file):
    infos, metadata = read_safetensors_header(file)
    assert metadata == {"format": "pt"}
    assert set(infos) == set(TENSORS)
    with RowReader() as reader:
        for name, value in TENSORS.items():
            info = infos[name]
            assert info.dtype == value.dtype and info.shape == tuple(value.shape)
            assert torch.equal(reader.read_rows(info), value)
        assert torch.equal(reader.read_rows(infos["matrix"], 2, 5), TENSORS["matrix"][2:5])
        assert torch.equal(reader.read_rows(infos["cube"], 1, 2), TENSORS["cube"][1:2])
        assert torch.equal(reader.read_rows(infos["bias"], 4, 5), TENSORS["bias"][4:5])


def test_shard_file_rows_in_any_order_read_back_with_safetensors(tmp_path):
    planned = [PlannedTensor(n, v.dtype, tuple(v.shape)) for n, v in TENSORS.items()]
    path = tmp_path / "out.safetensors"
    ShardFile.create(path, planned)
    shard = ShardFile(path, planned)
    for name, value in reversed(list(TENSORS.items())):  # any order: writes go to planned offsets
        if value.dim() >= 1 and value.shape[0] > 2:
            shard.write_rows(name, 2, value[2:])
            shard.write_rows(name, 0, value[:2])
        else:
            shard.write_rows(name, 0, value)
    shard.close()
    assert shard.bytes_written == sum(v.numel() * v.element_size() for v in TENSORS.values())
    loaded = load_file(str(path))
    assert set(loaded) == set(TENSORS)
    for name, value in TENSORS.items():
        assert torch.equal(loaded[name], value)
    with safe_open(str(path), framework="pt") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert (8 + struct.unpack("<Q", path.read_bytes()[:8])[0]) % 8 == 0  # header aligned


def test_shard_file_refuses_wrong_tensor_dtype_and_overflow(tmp_path):
    planned = [PlannedTensor("a", torch.float32, (2,)), PlannedTensor("b", torch.float32, (1,))]
    path = tmp_path / "w.safetensors"
    ShardFile.create(path, planned)
    shard = ShardFile(path, planned)
    with pytest.raises(RuntimeError, match="not planned"):
        shard.write_rows("c", 0, torch.zeros(1))
    with pytest.raises(RuntimeError, match="dtype"):
        shard.write_rows("a", 0, torch.zeros(2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="past the end"):
        shard.write_rows("a", 1, torch.zeros(2))
    shard.abort()


@pytest.mark.parametrize("map_min_bytes", [None, 1, 64])
def test_mapped_and_copied_reads_agree(file, map_min_bytes):
    # map_min_bytes=1 maps every range (offsets not page-aligned), 64 maps some, None copies all
    infos, _ = read_safetensors_header(file)
    with RowReader(map_min_bytes=map_min_bytes) as reader:
        for name, value in TENSORS.items():
            assert torch.equal(reader.read_rows(infos[name]), value)
        for start in range(7):
            for stop in range(start + 1, 8):
                assert torch.equal(reader.read_rows(infos["matrix"], start, stop), TENSORS["matrix"][start:stop])


def test_mapped_rows_are_copy_on_write(tmp_path):
    path = tmp_path / "big.safetensors"
    value = torch.arange(3 << 18, dtype=torch.float32).reshape(768, 1024)  # 3 MiB: mapped by default
    save_file({"w": value}, str(path))
    before = path.read_bytes()
    infos, _ = read_safetensors_header(path)
    with RowReader() as reader:
        rows = reader.read_rows(infos["w"], 5, 700)
        assert torch.equal(rows, value[5:700])
        rows.mul_(-1)  # a merge never does this; if it did, the file must not change
        assert torch.equal(reader.read_rows(infos["w"], 5, 700), value[5:700])
    assert path.read_bytes() == before


def test_mapped_read_of_a_truncated_file_is_refused(tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.ones(1024, 1024)}, str(path))
    infos, _ = read_safetensors_header(path)
    with open(path, "r+b") as handle:  # truncated after the header was read
        handle.truncate(path.stat().st_size - 4096)
    with RowReader() as reader, pytest.raises(CheckpointError, match=r"big\.safetensors: unexpected end.*'w'"):
        reader.read_rows(infos["w"], 1000, 1024)


def test_mapped_rows_release_their_mapping(tmp_path):
    path = tmp_path / "big.safetensors"
    save_file({"w": torch.ones(1024, 1024)}, str(path))
    infos, _ = read_safetensors_header(path)

    def mappings() -> int:
        return Path("/proc/self/maps").read_text().count(str(path))

    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    with RowReader() as reader:
        rows = reader.read_rows(infos["w"])
        view = rows[10:20]
        del rows
        assert mappings() == 1  # a view keeps it
        del view
        assert mappings() == 0


def test_truncated_file_is_named(file, tmp_path):
    data = file.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-3])
    with pytest.raises(CheckpointError, match=r"cut\.safetensors: truncated.*'(matrix|bias|scalar|ids|cube|empty)'"):
        read_safetensors_header(cut)


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\x00" * 4,
        struct.pack("<Q", 10**12) + b"{}",
        struct.pack("<Q", 4) + b"{{{{",
        struct.pack("<Q", 2) + b"[]",
    ],
)
def test_corrupt_headers(tmp_path, payload):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(payload)
    with pytest.raises(CheckpointError, match="bad.safetensors"):
        read_safetensors_header(path)


def test_inconsistent_offsets(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}).encode()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\x00" * 16)
    with pytest.raises(CheckpointError, match="tensor 'w' spans 8 bytes"):
        read_safetensors_header(path)
