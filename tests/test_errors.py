"""ram_trl/errors.py: the exception hierarchy callers catch."""

from __future__ import annotations

import pytest

from ram_trl.errors import CheckpointError, ConfigError, NonFiniteError, OutputError, RamTrlError


@pytest.mark.parametrize("error", [ConfigError, CheckpointError, NonFiniteError, OutputError])
def test_every_error_is_a_ram_trl_error(error):
    with pytest.raises(RamTrlError, match="^names the tensor$"):
        raise error("names the tensor")


def test_only_config_errors_are_value_errors():
    # argparse-style callers catch ValueError for bad configs; broken files and outputs are not bad values
    assert issubclass(ConfigError, ValueError)
    assert not any(issubclass(error, ValueError) for error in (CheckpointError, NonFiniteError, OutputError))
    assert not issubclass(RamTrlError, ValueError)


def test_errors_are_distinct():
    errors = [ConfigError, CheckpointError, NonFiniteError, OutputError]
    for error in errors:
        assert [other for other in errors if issubclass(error, other)] == [error]
