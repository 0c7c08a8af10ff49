"""Launching multi-process jobs from the tests: a free port, and the clean-up DeepSpeed's CPU backend needs."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path
from typing import Any

SHM = Path("/dev/shm")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for ``--master_port`` / ``--main_process_port``)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed_shm_buffers(port: int) -> list[Path]:
    """The shared-memory all-reduce buffers of a DeepSpeed job on ``port`` (CPU accelerator).

    DeepSpeed's ``deepspeed_shm_comm`` op creates ``/dev/shm/deepspeed_allreduce_buffer_{uid}_{addr}_{port}_{rank}``
    (67 MB each) at initialisation and never unlinks them: without clean-up every launch leaves them in RAM.
    """
    return sorted(SHM.glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*_{port}_*"))


def run_job(command: list[str], port: int, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)`` of a job listening on ``port``, then the removal of the job's leftover
    DeepSpeed shared-memory buffers (also when it failed or timed out)."""
    try:
        return subprocess.run(command, **kwargs)
    finally:
        for path in deepspeed_shm_buffers(port):
            path.unlink(missing_ok=True)
