"""Signal handlers around the library's own work: the caller's handlers survive, ignored signals stay ignored."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from ram_trl.signals import raising_signals
from tests._launch import free_port, run_job


class Caught(Exception):
    pass


def test_the_callers_handler_runs_first_and_is_restored_exactly():
    calls = []

    def own(signum, frame):
        calls.append(signum)

    before = signal.signal(signal.SIGUSR1, own)
    try:
        with pytest.raises(Caught), raising_signals((signal.SIGUSR1,), lambda s: Caught(s)):
            assert signal.getsignal(signal.SIGUSR1) is not own
            os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGUSR1) is own
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_an_ignored_signal_stays_ignored_during_and_after():
    before = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    try:
        with raising_signals((signal.SIGUSR2,), lambda s: Caught(s)):
            assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGUSR2)  # nothing happens
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)


def test_a_handler_the_body_installs_is_left_in_place():
    def theirs(signum, frame):
        pass

    before = signal.getsignal(signal.SIGUSR1)
    try:
        with raising_signals((signal.SIGUSR1,), lambda s: Caught(s)):
            signal.signal(signal.SIGUSR1, theirs)
        assert signal.getsignal(signal.SIGUSR1) is theirs
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_a_save_under_nohup_survives_a_sighup(tmp_path):
    """SIGHUP ignored by the process (``nohup``): a hang-up in the middle of an atomic save is ignored, the file is
    written, and SIGHUP is still ignored afterwards; the process's own SIGTERM handler is back."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from ram_trl.output import atomic_file

        def own(signum, frame):
            pass

        signal.signal(signal.SIGHUP, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, own)
        with atomic_file({str(tmp_path / "out.json")!r}) as temp:
            during = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            os.kill(os.getpid(), signal.SIGHUP)
            temp.write_text("{{}}")
        after = signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, signal.getsignal(signal.SIGTERM) is own
        print(during, *after)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["True", "True", "True"]
    assert (tmp_path / "out.json").read_text() == "{}"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_torchrun_merge_keeps_the_scripts_own_handlers(tmp_path):
    from ram_trl.synthetic import make_agent_set, make_base_checkpoint

    base = make_base_checkpoint(tmp_path / "base", hidden_size=16, num_layers=1, intermediate_size=32)
    agents = make_agent_set(base, tmp_path, densities=(0.1, 0.2), seed=1)
    config = tmp_path / "merge.json"
    models = [{"model": str(a)} for a in agents]
    config.write_text(json.dumps({"merge_method": "ram", "base_model": str(base), "models": models}))
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
    command += ["tests/_signal_merge_job.py", str(config), str(tmp_path / "out")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = run_job(command, port, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines().count("handlers kept") == 2, result.stdout
    assert (tmp_path / "out" / "ram_merge_report.json").is_file()
