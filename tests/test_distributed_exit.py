"""Ending the ranks of a distributed job without the exit-time abort of live gloo threads (docs/ci.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests._launch import free_port, run_job

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

JOB = Path(__file__).with_name("_exit_job.py")
ROOT = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, capture_output=True, text=True, timeout=300
    )


def test_exit_process_keeps_pythons_exit_steps() -> None:
    # atexit callbacks run, non-daemon threads are joined, idle pool workers do not hang the exit, buffered output
    # reaches the pipe, and the status is the one asked for
    run = _python(
        """
        import atexit, sys, threading, time
        from concurrent.futures import ThreadPoolExecutor
        from ram_trl.distributed import exit_process

        atexit.register(lambda: print("atexit ran"))
        pool = ThreadPoolExecutor(max_workers=2)
        pool.submit(time.sleep, 0.01).result()
        threading.Thread(target=lambda: (time.sleep(0.2), print("thread joined"))).start()
        print("buffered", end="")
        sys.stderr.write("to stderr")
        exit_process(3)
        """
    )
    assert run.returncode == 3, run.stderr
    assert "buffered" in run.stdout and "thread joined" in run.stdout and "atexit ran" in run.stdout
    assert run.stderr.endswith("to stderr")


def test_exit_distributed_is_a_normal_exit_without_communication_threads() -> None:
    run = _python(
        """
        from ram_trl.distributed import communication_threads, exit_distributed

        assert communication_threads() in ([], None)
        exit_distributed(5)
        """
    )
    assert run.returncode == 5, run.stderr


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from /proc")
def test_live_gloo_thread_at_exit_aborts_unless_the_rank_ends_with_exit_distributed(tmp_path) -> None:
    def launch(mode: str) -> tuple[subprocess.CompletedProcess, Path]:
        out = tmp_path / mode
        out.mkdir()
        port = free_port()
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["--master_port", str(port), str(JOB), mode, str(out)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        return run_job(command, port, env=env, capture_output=True, text=True, timeout=300), out

    plain, _ = launch("plain")
    output = plain.stdout + plain.stderr
    if plain.returncode == 0:  # the hazard this guards against is gone from torch/gloo
        pytest.skip("a gloo thread taking the GIL during finalization no longer aborts")
    assert "terminate called without an active exception" in output, output[-3000:]
    assert "exitcode  : -6" in output, output[-3000:]

    ended, out = launch("exit")
    assert ended.returncode == 0, (ended.stdout + ended.stderr)[-3000:]
    for rank in range(2):
        # the atexit callbacks ran, with the group's threads still alive (the group is held, as DeepSpeed does)
        alive = json.loads((out / f"rank{rank}.json").read_text())
        assert "pt_gloo_runloop" in alive, alive
