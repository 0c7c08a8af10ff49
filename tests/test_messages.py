"""One voice for errors and warnings (ram_trl.messages): pydantic errors in our words, did-you-mean, dtype aliases
accepted alike everywhere, each warning of a command printed once."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import yaml

import ram_trl
from ram_trl.cli import main
from ram_trl.errors import ConfigError
from ram_trl.messages import canonical_dtype, did_you_mean
from tests.helpers import config_for


@pytest.mark.parametrize(
    "name, choices, expected",
    [
        ("ram_pluss", ["ram", "ram_plus", "ties"], " (did you mean 'ram_plus'?)"),
        ("aplha", ["r", "alpha"], " (did you mean 'alpha'?)"),
        ("modles", ["models", "modules", "base_model"], " (did you mean 'models'?)"),  # swapped letters first
        ("zzz", ["models"], ""),
    ],
)
def test_did_you_mean(name, choices, expected):
    assert did_you_mean(name, choices) == expected


@pytest.mark.parametrize(
    "value, expected",
    [("bf16", "bfloat16"), ("FP16", "float16"), ("fp32", "float32"), ("torch.float16", "float16"), ("int8", "int8")],
)
def test_dtype_aliases(value, expected):
    assert canonical_dtype(value) == expected
    assert canonical_dtype(torch.bfloat16) == "bfloat16"


def _refused(config: dict) -> str:
    with pytest.raises(ConfigError) as info:
        ram_trl.merge(config, "unused", dry_run=True)
    return str(info.value)


def test_config_errors_in_our_words(ckpts):
    good = config_for(ckpts, "ram_plus")
    message = _refused({**good, "model": good["models"][0]["model"]})
    assert message == "merge config: unknown field 'model' (did you mean 'models'?); remove it or correct its name"
    message = _refused({**good, "out_dtype": "bf17"})
    assert message.startswith("merge config: out_dtype: unknown dtype 'bf17' (did you mean 'bf16'?); use one of")
    message = _refused({**good, "seed": "soon"})
    assert message == "merge config: seed = 'soon': must be a valid integer, unable to parse string as an integer"
    assert "Value error" not in _refused({**good, "out_dtype": "bf17"})
    message = _refused({**good, "merge_method": "ram_pluss"})
    assert message.startswith("merge config: unknown merge_method 'ram_pluss' (did you mean 'ram_plus'?); available:")


def test_recipe_and_telemetry_accept_the_aliases():
    from ram_trl.callbacks.telemetry.precision import resolve_save_dtype
    from ram_trl.recipes.schema import WarmStartSpec

    assert resolve_save_dtype("bf16") is torch.bfloat16
    assert resolve_save_dtype("fp32") is torch.float32
    assert WarmStartSpec(save_dtype="fp16").save_dtype == "float16"


def test_convert_gguf_accepts_the_aliases(tmp_path, capsys):
    missing = tmp_path / "missing.gguf"
    assert main(["convert-gguf", str(missing), str(tmp_path / "out"), "--dtype", "bf16", "--no-progress"]) == 2
    assert "missing.gguf" in capsys.readouterr().err  # refused for the file, not for the dtype


def test_an_unknown_parameter_is_warned_once_with_a_suggestion(ckpts, tmp_path, capsys):
    config = config_for(ckpts, "ram_plus", parameters={"r": 0.2, "aplha": 2.0})
    path = tmp_path / "merge.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    assert main(["merge", str(path), str(tmp_path / "out"), "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert err.count("'aplha'") == 1, err
    assert "'aplha' (parameters) (did you mean 'alpha'?)" in err
    assert "UserWarning" not in err and "warnings.warn" not in err
    assert "warning: " in err


def test_the_library_still_warns_through_python_warnings(ckpts, tmp_path):
    config = config_for(ckpts, "ram_plus", parameters={"aplha": 2.0})
    with pytest.warns(UserWarning, match="did you mean 'alpha'"):
        ram_trl.merge(config, Path(tmp_path / "out"), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert main(["methods"]) == 0  # the command line's voice leaves the host's warning filters as they were


def test_deepspeed_cpu_notice_is_dropped_only_in_the_command_lines_process():
    import logging

    from ram_trl.messages import one_voice

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        notice = "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."
        with one_voice():
            logger.warning(notice)
            logger.warning("another DeepSpeed warning")
        logger.warning(notice)  # a user's process (the library, callbacks): left as DeepSpeed says it
    finally:
        logger.removeHandler(handler)
    assert seen == ["another DeepSpeed warning", notice]
