"""Signal handlers for work the library owns: installed on entry, restored exactly on exit."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any


@contextlib.contextmanager
def raising_signals(signals: Iterable[int], error: Callable[[int], BaseException]) -> Iterator[None]:
    """While the body runs, each of ``signals`` raises ``error(signum)`` so that its cleanup runs.

    A Python handler the caller installed is called first; a signal the caller ignores (``SIG_IGN``, e.g. SIGHUP
    under ``nohup``) stays ignored, and one handled outside Python is left alone. On exit every handler this
    installed is put back exactly as it was (unless the body replaced it). Off the main thread, where Python
    cannot install handlers, nothing is changed."""
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
