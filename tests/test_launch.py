"""The test launcher (tests/_launch.py): a job's whole process group dies with it, so a timed-out job leaves no
orphaned rank or compiler, and no just-in-time build lock that would hang every later DeepSpeed job."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests._launch import free_port, run_job

# a "launcher" that starts a "rank", which creates a build lock and writes its pid, then both sleep
JOB = textwrap.dedent(
    """
    import os, subprocess, sys, time
    rank = (
        "import os, pathlib, sys, time; root = pathlib.Path(sys.argv[1]);"
        "(root / 'ext' / 'op').mkdir(parents=True); (root / 'ext' / 'op' / 'lock').touch();"
        "(root / 'rank.pid').write_text(str(os.getpid())); time.sleep(600)"
    )
    subprocess.Popen([sys.executable, "-c", rank, sys.argv[1]])
    time.sleep(600)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie waiting for its reaper counts as dead
        return handle.read().split(")")[-1].split()[0] != "Z"


def test_a_timed_out_job_leaves_no_orphan_and_no_build_lock(tmp_path):
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    env.pop("DS_ACCELERATOR", None)
    (tmp_path / "ext").mkdir()
    (tmp_path / "ext" / "older").mkdir()
    (tmp_path / "ext" / "older" / "lock").touch()  # not this job's: kept
    os.utime(tmp_path / "ext" / "older" / "lock", (time.time() - 3600, time.time() - 3600))
    with pytest.raises(subprocess.TimeoutExpired):  # 20 s: time for the rank to start on a loaded machine
        run_job([sys.executable, "-c", JOB, str(tmp_path)], free_port(), env=env, timeout=20)
    pid = int((tmp_path / "rank.pid").read_text())
    for _ in range(50):
        if not _alive(pid):
            break
        time.sleep(0.1)
    assert not _alive(pid), "the rank outlived its timed-out launcher"
    assert not (tmp_path / "ext" / "op" / "lock").exists()
    assert (tmp_path / "ext" / "older" / "lock").exists()


def test_a_finished_job_returns_like_subprocess_run(tmp_path):
    result = run_job(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        free_port(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout, result.stderr) == (3, "out\n", "err\n")
