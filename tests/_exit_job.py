"""One rank of a 2-process gloo job that ends while one of its gloo threads is about to run Python.

Run by tests/test_distributed_exit.py: ``python -m torch.distributed.run --nproc_per_node 2 _exit_job.py MODE OUT``.
Rank 1 keeps a reference to the group (as DeepSpeed keeps its groups, so ``destroy_process_group`` leaves their
threads running) and ends its script while its last collective, with a Python callback, is still running on a gloo
thread: rank 0 joins that collective only a moment later. ``MODE`` ``plain`` ends with ``destroy_process_group``;
the gloo thread then takes the GIL while the interpreter finalizes, and the process aborts ("terminate called without
an active exception", exit -6). ``exit`` ends with :func:`ram_trl.distributed.exit_distributed`. An ``atexit``
callback writes ``OUT/rank{R}.json``: the communication threads alive at exit.
"""

from __future__ import annotations

import atexit
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ram_trl.distributed import communication_threads, exit_distributed  # noqa: E402

#: Seconds rank 0 waits before joining the last collective.
LATE = 2.0


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    atexit.register(lambda: (out / f"rank{rank}.json").write_text(json.dumps(communication_threads())))
    held = dist.group.WORLD
    if rank == 0:
        time.sleep(LATE)
    work = dist.all_reduce(torch.ones(8), async_op=True)
    done = work.get_future().then(lambda future: future.value())  # run by the gloo thread that completes the work
    if rank == 0:
        done.wait()
    if mode == "exit":
        exit_distributed()
    dist.destroy_process_group()
