"""``ram_trl.io.config_file``: a merge config that is not a readable YAML file is one line naming it."""

from __future__ import annotations

import os

import pytest

from ram_trl.errors import ConfigError
from ram_trl.merging.config.schema import load_config


def _refused(source, *parts):
    with pytest.raises(ConfigError) as exc:
        load_config(source)
    message = str(exc.value)
    assert "\n" not in message, message
    for part in parts:
        assert part in message, message


def test_a_directory_or_fifo_given_as_the_config_is_named_as_such(tmp_path):
    _refused(tmp_path, str(tmp_path), "is a directory")
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    _refused(fifo, str(fifo), "is a FIFO")  # never opened: reading it would block
    _refused(tmp_path / "missing.yaml", "does not exist")


def test_yaml_nested_20000_deep_is_one_line(tmp_path):
    for text in ("[" * 20_000 + "]" * 20_000, "".join(" " * i + "a:\n" for i in range(20_000))):
        path = tmp_path / "deep.yaml"
        path.write_text(text)
        _refused(path, str(path), "nested more than 200 levels")


def test_empty_slices_are_one_line(tmp_path):
    for key in ("slices",):
        path = tmp_path / f"{key}.yaml"
        path.write_text(f"merge_method: ties\nbase_model: {tmp_path}\n{key}: []\n")
        _refused(path, f"'{key}' is empty")
