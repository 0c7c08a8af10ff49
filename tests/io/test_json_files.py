"""ram_trl/io/json_files.py: a JSON file beside the tensors is an object, or one error naming the file."""

from __future__ import annotations

import pytest

from ram_trl.errors import CheckpointError, ConfigError
from ram_trl.io.json_files import json_object_or_none, read_json_object


def test_an_object_is_read(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 8}')
    assert read_json_object(tmp_path / "config.json", "base model") == {"hidden_size": 8}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{not json", "base model {path}: not valid JSON"),
        ("[1, 2]", "base model {path}: must hold a JSON object, got list"),
    ],
)
def test_bad_files_name_the_file(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(CheckpointError) as info:
        read_json_object(path, "base model")
    assert str(info.value).startswith(message.format(path=path))
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_json_object(tmp_path / "missing.json", "stage", ConfigError)


def test_a_record_that_cannot_be_trusted_reads_as_none(tmp_path):
    """Records a run may redo (a conversion, a warm start, an evaluation) read as ``None`` unless they are objects."""
    file = tmp_path / "record.json"
    assert json_object_or_none(file) is None  # missing
    for text, expected in [('{"a": 1}', {"a": 1}), ("[1]", None), ("{not json", None)]:
        file.write_text(text)
        assert json_object_or_none(file) == expected
    file.write_bytes(b"\xff\xfe")  # not UTF-8
    assert json_object_or_none(file) is None
