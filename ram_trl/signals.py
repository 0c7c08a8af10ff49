"""Signal handlers for work the library owns: installed on entry, restored exactly on exit."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

_CAUGHT_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


class Interrupted(KeyboardInterrupt):
    """A catchable termination signal (SIGTERM, SIGHUP) arrived while an output was being written."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"terminated by signal {signum}")
        self.signum = signum


@contextlib.contextmanager
def raising_signals(signals: Iterable[int], error: Callable[[int], BaseException]) -> Iterator[None]:
    """While the body runs, each of ``signals`` raises ``error(signum)`` so that its cleanup runs. The caller's Python
    handler is called first; ``SIG_IGN`` (SIGHUP under ``nohup``) and handlers outside Python are left alone; every
    handler is restored exactly on exit (unless the body replaced it); off the main thread nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, Any] = {}

    def handler(signum: int, frame: Any) -> None:
        before = previous.get(signum)
        if callable(before):
            before(signum, frame)
        raise error(signum)

    for signum in signals:
        before = signal.getsignal(signum)
        if before is signal.SIG_IGN or before is None:
            continue
        previous[signum] = before
        signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, before in previous.items():
            if signal.getsignal(signum) is handler:
                signal.signal(signum, before)


def catch_signals() -> contextlib.AbstractContextManager[None]:
    """Turn SIGTERM and SIGHUP into :class:`Interrupted` (SIGINT already raises ``KeyboardInterrupt``), so that
    ``finally`` blocks and ``except BaseException`` cleanups run; see :func:`~ram_trl.signals.raising_signals`."""
    return raising_signals(_CAUGHT_SIGNALS, Interrupted)


__all__ = ["Interrupted", "catch_signals", "raising_signals"]
