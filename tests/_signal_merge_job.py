"""A torchrun rank that owns its SIGTERM handler and ignores SIGHUP (as under ``nohup``), then merges.

Usage: ``torchrun --nproc_per_node=2 tests/_signal_merge_job.py CONFIG OUT``; prints ``handlers kept`` when both
are as the script left them after the merge.
"""

import signal
import sys

import ram_trl


def own_handler(signum, frame):
    raise SystemExit(f"own handler: {signum}")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, own_handler)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    ram_trl.merge(sys.argv[1], sys.argv[2], progress=False)
    found = (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP))
    print("handlers kept" if found == (own_handler, signal.SIG_IGN) else f"handlers changed: {found}", flush=True)
