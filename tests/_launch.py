"""Launching multi-process jobs from the tests: a free port, and the clean-up DeepSpeed's CPU backend needs.

A job runs in its own process group, killed as a whole when it ends or times out: ``subprocess.run(timeout=...)``
kills only the launcher, and its ranks (and a compiler they started) would live on as orphans, holding ports, memory
and the just-in-time build's ``lock`` file that makes every later DeepSpeed job wait forever. DeepSpeed's CPU
communication extension is built once per session before the first DeepSpeed job (:func:`build_deepspeed_ops`), so
a job's timeout never includes a compile (minutes on a loaded machine).
"""

from __future__ import annotations

import contextlib
import functools
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHM = Path("/dev/shm")
#: Where :func:`free_port` draws from: below the ephemeral range, above most services' fixed ports.
PORTS = range(20000, 32768)
#: The one-time build of DeepSpeed's CPU extension: a few minutes on a loaded 2-core machine.
BUILD_TIMEOUT = 1800


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``--master_port`` / ``--main_process_port``).

    Drawn below Linux's ephemeral range (32768-60999), where no outgoing connection can take it before the job binds
    it; under pytest-xdist each worker draws only ports of its own residue modulo the number of workers, so two
    workers never hand the same port to two jobs started at the same time.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker.removeprefix("gw")) % count if worker.startswith("gw") else 0
    draw = random.Random()  # not the global generator: tests may seed it
    for _ in range(1000):
        port = draw.randrange(PORTS.start + index, PORTS.stop, count)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORTS} (residue {index} modulo {count}) after 1,000 tries")


def deepspeed_shm_buffers(port: int) -> list[Path]:
    """The shared-memory all-reduce buffers of a DeepSpeed job on ``port`` (CPU accelerator).

    DeepSpeed's ``deepspeed_shm_comm`` op creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}``
    (67 MB each) at initialisation and never unlinks them: without clean-up every launch leaves them in RAM.
    """
    return sorted(SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def _extension_locks(env: dict[str, str] | None) -> list[Path]:
    root = (env or os.environ).get("TORCH_EXTENSIONS_DIR")
    root_path = Path(root) if root else Path.home() / ".cache" / "torch_extensions"
    return sorted(root_path.glob("**/lock")) if root_path.is_dir() else []


@functools.cache
def build_deepspeed_ops(extensions_dir: str | None) -> None:
    """Build DeepSpeed's CPU shared-memory communication extension (what every rank of a CPU DeepSpeed job loads)
    once, without a time limit, so that jobs only load it."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    if extensions_dir:
        env["TORCH_EXTENSIONS_DIR"] = extensions_dir
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    process = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        _, stderr = process.communicate(timeout=BUILD_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        raise RuntimeError(
            f"building DeepSpeed's CPU extension took over {BUILD_TIMEOUT} s: a stale build lock? "
            f"{[str(p) for p in _extension_locks(env)]} (docs/ci.md)"
        ) from None
    if process.returncode != 0:
        raise RuntimeError(f"building DeepSpeed's CPU extension failed:\n{stderr[-4000:]}")


def run_job(
    command: list[str], port: int, *, timeout: float | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, timeout=timeout, **kwargs)`` of a job listening on ``port``, in its own process
    group, which is killed as a whole when the job ends or times out (no orphaned rank or compiler), then the removal
    of the job's leftover DeepSpeed shared-memory buffers (also when it failed or timed out).

    A DeepSpeed job (``DS_ACCELERATOR=cpu`` in its environment) first gets the extension built
    (:func:`build_deepspeed_ops`). If the job had to be killed, a just-in-time build ``lock`` it created is removed
    (its builder is dead; left behind it would hang every later job).
    """
    env = kwargs.get("env")
    if (env or os.environ).get("DS_ACCELERATOR") == "cpu":
        build_deepspeed_ops((env or os.environ).get("TORCH_EXTENSIONS_DIR"))
    if kwargs.pop("capture_output", False):
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    started = time.time()
    killed = False
    process = subprocess.Popen(command, start_new_session=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
        return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    except BaseException:
        killed = True
        raise
    finally:
        with contextlib.suppress(ProcessLookupError):  # ranks (and their children) that outlived the launcher
            os.killpg(process.pid, signal.SIGKILL)
        if killed:
            process.communicate()
            for lock in _extension_locks(env):
                with contextlib.suppress(OSError):
                    if lock.stat().st_mtime >= started:
                        lock.unlink()
        for path in deepspeed_shm_buffers(port):
            path.unlink(missing_ok=True)
