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
    line = "handlers kept" if found == (own_handler, signal.SIG_IGN) else f"handlers changed: {found}"
    # one write per rank: the ranks share torchrun's stdout pipe, and print() writes the text and its newline apart
    # (two ranks' lines interleaved as "handlers kepthandlers kept\n\n"); a write under PIPE_BUF is not split
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
