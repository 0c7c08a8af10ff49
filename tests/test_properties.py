"""Property-based hostile inputs (hypothesis): random malformed safetensors headers, index files and merge configs.

Whatever the input, ``ram-trl merge`` exits 0 or 2 (never a traceback); on 0 every output value is finite; on 2
there is one ``error:`` line and no output; never a temporary sibling left; the inputs are never modified.
Budgets are small and derandomized so CI sees the same examples on every run.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from ram_trl.cli import main
from tests.helpers import BIAS, DOWN, EMBED, UP, make_checkpoints, snapshot

NAMES = [EMBED, UP, BIAS, DOWN]
PROFILE = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**66), max_value=2**66),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.sampled_from(
        ["F32", "BF16", "F16", "I64", "F64", "U8", "BOOL", "model.safetensors", "../base/model.safetensors"]
    ),
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=8,
)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return make_checkpoints(tmp_path_factory.mktemp("pristine") / "inputs").root


@contextlib.contextmanager
def workspace(pristine: Path):
    root = Path(tempfile.mkdtemp(prefix="ram-trl-prop-"))
    try:
        shutil.copytree(pristine, root / "inputs")
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_merge(root: Path, config: dict[str, Any]) -> None:
    """Run ``ram-trl merge`` and check the properties."""
    config_path = root / "merge.yaml"
    config_path.write_text(yaml.safe_dump(config, sort_keys=False))
    before = snapshot(root / "inputs")
    out = root / "outputs" / "merged"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main(["merge", str(config_path), str(out), "--no-progress"])
    err = stderr.getvalue()
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 0:
        for name, value in load_file(str(out / "model.safetensors")).items():
            if value.dtype.is_floating_point:
                assert bool(torch.isfinite(value).all()), f"non-finite output in {name}"
    else:
        assert len([line for line in err.splitlines() if ": error: " in line]) == 1, err
        assert not (root / "outputs").exists()
    siblings = [p.name for p in (root / "outputs").iterdir()] if (root / "outputs").exists() else []
    assert siblings in ([], ["merged"]), siblings
    assert snapshot(root / "inputs") == before


def _base_config(root: Path, method: str = "ram_plus") -> dict[str, Any]:
    inputs = root / "inputs"
    return {
        "merge_method": method,
        "base_model": str(inputs / "base"),
        "models": [{"model": str(inputs / "agent0")}, {"model": str(inputs / "agent1")}],
    }


def _read_header(file: Path) -> tuple[dict[str, Any], bytes]:
    data = file.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def _write_header(file: Path, header: dict[str, Any], body: bytes) -> None:
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    file.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)


header_edits = st.lists(
    st.tuples(
        st.sampled_from([*NAMES, "__metadata__", "extra.tensor"]),
        st.sampled_from(["dtype", "shape", "data_offsets", None, "whole"]),
        json_values,
    ),
    min_size=1,
    max_size=3,
)


@PROFILE
@given(edits=header_edits, body_cut=st.integers(min_value=0, max_value=64), which=st.sampled_from(["base", "agent1"]))
def test_random_safetensors_headers(pristine, edits, body_cut, which):
    with workspace(pristine) as root:
        file = root / "inputs" / which / "model.safetensors"
        header, body = _read_header(file)
        for name, key, value in edits:
            if key == "whole" or name == "__metadata__" or name not in header:
                header[name] = value
            elif key is None:
                header.pop(name, None)
            elif isinstance(header[name], dict):
                header[name][key] = value
        _write_header(file, header, body[: len(body) - body_cut])
        run_merge(root, _base_config(root))


weight_maps = st.one_of(
    json_values,
    st.dictionaries(
        st.sampled_from([*NAMES, "other"]),
        st.one_of(
            st.sampled_from(
                ["model.safetensors", "../agent0/model.safetensors", "/etc/hostname", "", "missing.safetensors"]
            ),
            json_scalars,
        ),
        max_size=5,
    ),
)


@PROFILE
@given(weight_map=weight_maps, wrap=st.booleans())
def test_random_index_files(pristine, weight_map, wrap):
    with workspace(pristine) as root:
        index = {"metadata": {}, "weight_map": weight_map} if wrap else weight_map
        (root / "inputs" / "agent1" / "model.safetensors.index.json").write_text(json.dumps(index))
        run_merge(root, _base_config(root))


numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-3, max_value=3),
    st.integers(min_value=-5, max_value=5),
    st.sampled_from([0, 1e-300, 1e39, -0.0, 3e38]),
    st.booleans(),
    st.text(max_size=4),
    st.none(),
)
filter_rules = st.lists(
    st.fixed_dictionaries(
        {"value": numbers}, optional={"filter": st.one_of(st.sampled_from(["up_proj", "embed", "*"]), json_scalars)}
    ),
    max_size=3,
)
parameter_values = st.one_of(numbers, filter_rules)
parameter_names = st.sampled_from(
    ["weight", "density", "lambda", "r", "alpha", "eps", "normalize", "rescale", "rho_scope", "fisher_floor", "bogus"]
)
methods = st.sampled_from(
    ["ram", "ram_plus", "ram_plus_soft", "ramplus_tl", "task_arithmetic", "ties", "dare_linear", "dare_ties", "linear"]
)


@PROFILE
@given(
    method=methods,
    global_params=st.dictionaries(parameter_names, parameter_values, max_size=3),
    agent_params=st.lists(st.dictionaries(parameter_names, parameter_values, max_size=2), min_size=2, max_size=2),
    extra=st.dictionaries(
        st.sampled_from(["seed", "out_dtype", "shape_mismatch", "dtype", "tokenizer_source"]), json_scalars, max_size=2
    ),
)
def test_random_merge_configs(pristine, method, global_params, agent_params, extra):
    with workspace(pristine) as root:
        config = _base_config(root, method)
        config["parameters"] = global_params
        for entry, params in zip(config["models"], agent_params, strict=True):
            entry["parameters"] = params
        config.update(extra)
        run_merge(root, config)


def test_the_properties_hold_for_a_valid_merge(pristine):
    """The harness itself: a valid config merges (exit 0, finite output)."""
    with workspace(pristine) as root:
        run_merge(root, _base_config(root, "task_arithmetic"))
        assert (root / "outputs" / "merged" / "model.safetensors").is_file()
