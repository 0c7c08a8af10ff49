"""ram_trl.sizes: the one byte-size parser (shard sizes, chunk budgets, synthetic checkpoints) and its formatting."""

from __future__ import annotations

import pytest

from ram_trl import defaults
from ram_trl.errors import ConfigError
from ram_trl.merging.planner import DEFAULT_CHUNK_BUDGET, DEFAULT_MAX_SHARD_SIZE
from ram_trl.sizes import FLOAT32_MAX, check_number, check_optional_number, format_bytes, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5GB", 5_000_000_000),
        ("256MB", 256_000_000),
        ("20KB", 20_000),
        ("2TB", 2_000_000_000_000),
        ("500MiB", 500 * 2**20),
        ("1GiB", 2**30),
        ("3KiB", 3072),
        ("1TiB", 2**40),
        ("7K", 7_000),
        ("7M", 7_000_000),
        ("7G", 7_000_000_000),
        ("1048576", 1_048_576),
        ("12B", 12),
        (" 5 gb ", 5_000_000_000),  # case and spaces do not matter
        ("5Gb", 5_000_000_000),  # a lowercase b is a byte unless asked otherwise
        ("1.5GB", 1_500_000_000),
        ("4.35MB", 4_350_000),  # exact: float arithmetic would give 4,349,999
        ("0.5KiB", 512),
        (1234, 1234),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1Gb", 125_000_000),  # transformers' max_shard_size: a lowercase final b counts bits
        ("20kb", 2_500),
        ("8MB", 8_000_000),
        ("1GiB", 2**30),  # binary units are always bytes
        ("1gib", 2**30),
        ("16b", 16),
        ("100", 100),
    ],
)
def test_parse_size_with_transformers_bits(text, expected):
    assert parse_size(text, lowercase_b_is_bits=True) == expected


@pytest.mark.parametrize("text", ["", "GB", "five GB", "5 XB", "-5GB", "5GBs", "1e9"])
def test_parse_size_refuses_what_is_not_a_size(text):
    with pytest.raises(ConfigError, match="cannot parse size") as info:
        parse_size(text)
    assert isinstance(info.value, ValueError)


def test_defaults_are_parsed_by_the_same_parser():
    assert DEFAULT_CHUNK_BUDGET == parse_size(defaults.CHUNK_BUDGET) == 256_000_000
    assert DEFAULT_MAX_SHARD_SIZE == parse_size(defaults.MAX_SHARD_SIZE) == 5_000_000_000


@pytest.mark.parametrize(
    ("num", "text"),
    [(0, "0 B"), (999, "999 B"), (1000, "1.00 KB"), (1_536_000, "1.54 MB"), (5e9, "5.00 GB"), (2e15, "2000.00 TB")],
)
def test_format_bytes(num, text):
    assert format_bytes(num) == text


WHERE = "merge.yaml: models[1] (./coder)"


def test_numbers_within_bounds_become_floats():
    assert check_number(3, WHERE, "weight") == 3.0
    assert type(check_number(3, WHERE, "weight")) is float
    assert check_number(0.0, WHERE, "density", minimum=0.0, maximum=1.0) == 0.0
    assert check_number(1.0, WHERE, "density", minimum=0.0, maximum=1.0) == 1.0
    assert check_number(FLOAT32_MAX, WHERE, "lambda") == FLOAT32_MAX
    assert check_number(4.0, WHERE, "rank", integer=True) == 4.0
    assert check_optional_number(None, WHERE, "r", minimum=0.0) is None
    assert check_optional_number(2, WHERE, "r", minimum=0.0) == 2.0


@pytest.mark.parametrize(
    ("value", "bounds", "message"),
    [
        (True, {}, "weight must be a number, got True"),
        ("1", {}, "weight must be a number, got '1'"),
        (float("nan"), {}, "weight must be a finite number, got nan"),
        (1e39, {}, "weight is 1e+39, beyond float32"),
        (2.5, {"integer": True}, "weight must be a whole number, got 2.5"),
        (-0.5, {"minimum": 0.0}, "weight must be >= 0.0, got -0.5"),
        (1.5, {"maximum": 1.0}, "weight must be <= 1.0, got 1.5"),
        (0.0, {"above": 0.0}, "weight must be > 0.0, got 0.0"),
    ],
)
def test_bad_numbers_name_the_place_and_field(value, bounds, message):
    with pytest.raises(ConfigError) as info:
        check_number(value, WHERE, "weight", **bounds)
    assert str(info.value).startswith(f"{WHERE}: {message}")
