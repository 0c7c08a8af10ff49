"""TaskVectorSparsityCallback in a real TRL PPO run (``trl.experimental.ppo.PPOTrainer``, TRL 1.9.2).

PPO was removed from TRL after 1.9.x, so the run happens in a separate virtualenv this module makes on first use
(``.venv-ppo`` in the repository) and reuses after. It holds only trl 1.9.2 and transformers 5.23 (and whatever of
their requirements the test's own environment does not satisfy); everything else, torch and this package included,
it reads from the environment running the tests (a ``.pth`` file adds that site-packages after its own), so it
takes seconds to make instead of reinstalling torch and the Hugging Face stack.
PPO's callbacks receive a policy + value wrapper: the telemetry must measure the policy alone. The assertions are the
core callback tests': the metrics in ``log_history`` and TensorBoard, the last measurement equal to ``ram-trl
analyze`` of the saved policy (bf16, eps 1e-5), and the stage manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from safetensors import safe_open

from ram_trl.stage.manifest import read_manifest
from ram_trl.synthetic import make_base_checkpoint
from tests.helpers import assert_stage_manifest, assert_telemetry_is_the_analysis, assert_telemetry_logged

pytestmark = [pytest.mark.slow, pytest.mark.network]

REPO = Path(__file__).resolve().parents[1]
PPO_VENV = REPO / ".venv-ppo"
#: What the PPO virtualenv installs over the test environment's packages.
PPO_REQUIREMENTS = ("trl==1.9.2", "transformers==5.23.*")
#: The test environment's site-packages, which the PPO virtualenv reads after its own.
PARENT_SITE = sysconfig.get_paths()["purelib"]
JOB = Path(__file__).with_name("_ppo_job.py")
STEPS = 3


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", *args],
        check=True,
        capture_output=True,
        text=True,
        timeout=1800,
    )


@pytest.fixture(scope="session")
def ppo_python() -> Path:
    """The python of the TRL 1.9.2 virtualenv, made (once) on first use, layered over the test environment."""
    python = PPO_VENV / "bin" / "python"
    marker = PPO_VENV / ".ram_trl_requirements"
    wanted = json.dumps({"requirements": PPO_REQUIREMENTS, "parent": PARENT_SITE})
    if python.exists() and marker.is_file() and marker.read_text() == wanted:
        return python
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(PPO_VENV)], check=True, capture_output=True, text=True
        )
        own_site = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        # a .pth line starting with "import" runs: addsitedir also processes the parent's .pth files (editable
        # installs), and appends, so the virtualenv's own trl and transformers come first on sys.path
        (Path(own_site) / "_ram_trl_test_environment.pth").write_text(
            f"import site; site.addsitedir({PARENT_SITE!r})\n"
        )
        # pip leaves the parent's packages alone ("outside environment") and installs the pinned versions here
        _pip(python, *PPO_REQUIREMENTS)
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or exc.stdout or "").strip().splitlines()[-3:]
        pytest.skip(f"cannot make the TRL 1.9.2 virtualenv for PPO at {PPO_VENV}: {' / '.join(tail)}")
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot make the TRL 1.9.2 virtualenv for PPO at {PPO_VENV}: {exc}")
    marker.write_text(wanted)
    return python


@pytest.fixture(scope="module")
def ppo_run(ppo_python, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("ppo")
    base = make_base_checkpoint(root / "base", hidden_size=32, num_layers=2, intermediate_size=64)
    out = root / "agent"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [str(ppo_python), str(JOB), str(base), str(out)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, f"PPO job failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return {"base": base, "out": out, **json.loads((out / "ppo_result.json").read_text())}


def test_ppo_runs_trl_1_9_and_measures_the_policy_against_the_reference_model(ppo_run) -> None:
    manifest = read_manifest(ppo_run["out"])
    # the virtualenv's own trl and transformers, not the test environment's (TRL 1.16, transformers 5.24)
    assert manifest.versions["trl"] == "1.9.2"
    assert manifest.versions["transformers"].startswith("5.23.")
    assert manifest.trainer == "PPOTrainer"
    # the callback received the policy + value wrapper; the cheapest base is PPO's reference model
    assert ppo_run["model_class"] == "PolicyAndValueWrapper"
    assert ppo_run["base_source"] == "reference model"
    assert ppo_run["max_steps"] == STEPS


def test_ppo_metrics_reach_log_history_and_tensorboard(ppo_run) -> None:
    # measured at the logging step (2) and the final step (3), in entries of their own (PPO has no metric store)
    assert_telemetry_logged(ppo_run["log_history"], ppo_run["last"], ppo_run["out"], [2, STEPS])


def test_ppo_last_measurement_equals_ram_trl_analyze_of_the_saved_policy(ppo_run) -> None:
    base, out = ppo_run["base"], ppo_run["out"]
    # the saved agent is the policy alone, in bf16
    with (
        safe_open(str(out / "model.safetensors"), "pt") as saved,
        safe_open(str(base / "model.safetensors"), "pt") as original,
    ):
        names = saved.keys()
        assert set(names) == set(original.keys())
        assert {str(saved.get_slice(name).get_dtype()) for name in names} == {"BF16"}
    # numel: the policy's elements, not the value model's
    assert_telemetry_is_the_analysis(ppo_run["last"], base, out, "full")


def test_ppo_stage_manifest(ppo_run) -> None:
    base, out = ppo_run["base"], ppo_run["out"]
    manifest = assert_stage_manifest(out, base, ppo_run["last"], ppo_run["log_history"], "full", STEPS)
    assert manifest.stage == "ppo" and manifest.domain == "test"
    assert "objective/rlhf_reward" in manifest.rewards
