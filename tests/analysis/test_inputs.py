"""ram_trl/analysis/inputs.py: how :func:`ram_trl.analyze`'s arguments resolve (the CLI's error messages are checked
in tests/test_analysis.py)."""

from __future__ import annotations

import pytest

from ram_trl import defaults
from ram_trl.analysis.inputs import resolve_inputs
from ram_trl.errors import ConfigError
from tests.helpers import config_for


def test_paths_and_defaults(ckpts):
    inputs = resolve_inputs(ckpts.base, ckpts.agents, None, None, None)
    assert (inputs.eps, inputs.r, inputs.alpha) == (defaults.EPS, defaults.R, defaults.ALPHA)
    assert inputs.resolved.base_path == ckpts.base
    assert [a.path for a in inputs.resolved.agents] == ckpts.agents
    # the merge's density warnings read eps from the parameters
    assert {k: inputs.resolved.params[k] for k in ("eps", "r", "alpha")} == {"eps": 1e-5, "r": 0.1, "alpha": 2.0}


def test_arguments_override_and_are_floats(ckpts):
    inputs = resolve_inputs(ckpts.base, ckpts.agents, 0, 1, 3, names=["coding", "tools"])
    assert (inputs.eps, inputs.r, inputs.alpha) == (0.0, 1.0, 3.0)
    assert all(type(v) is float for v in (inputs.eps, inputs.r, inputs.alpha))
    assert [a.name for a in inputs.resolved.agents] == ["coding", "tools"]


def test_a_config_supplies_the_parameters(ckpts):
    config = config_for(ckpts, "ram_plus", parameters={"eps": 1e-3, "r": 0.5})
    inputs = resolve_inputs(None, [], None, None, 4.0, config=config)
    assert (inputs.eps, inputs.r, inputs.alpha) == (1e-3, 0.5, 4.0)


@pytest.mark.parametrize(("key", "value"), [("eps", -1.0), ("r", float("nan")), ("alpha", "2")])
def test_bad_numbers_are_refused(ckpts, key, value):
    numbers = {"eps": None, "r": None, "alpha": None, key: value}
    with pytest.raises(ConfigError, match=f"--{key}"):
        resolve_inputs(ckpts.base, ckpts.agents, **numbers)


def test_the_base_as_its_only_agent_is_refused(ckpts):
    with pytest.raises(ConfigError, match="every agent is the base model"):
        resolve_inputs(ckpts.base, [ckpts.base], None, None, None)
