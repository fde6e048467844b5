"""
SIGINT/SIGTERM in a tuning process: the first one becomes ``KeyboardInterrupt`` (the running trial fails and the
study is kept), later ones are ignored so that clean-up can finish.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


def _ignore_signal(signum: int, frame: Any) -> None:
    """A Python-level no-op rather than ``SIG_IGN``: a signal already on its way then passes silently."""


_interrupted = threading.Event()


def interrupt_handler(signum: int, frame: Any) -> None:
    """
    SIGINT/SIGTERM -> ``KeyboardInterrupt`` once; later signals are ignored so that clean-up can finish.

    Python swallows an exception raised where the signal lands inside a weakref callback or ``__del__`` (garbage
    collection), so the interrupt is also recorded, and :func:`raise_if_interrupted` raises it again at the next env
    step of a trial.
    """
    signal.signal(signal.SIGINT, _ignore_signal)
    signal.signal(signal.SIGTERM, _ignore_signal)
    _interrupted.set()
    raise KeyboardInterrupt


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if :func:`interrupt_handler` ran since :func:`clear_interrupt`."""
    if _interrupted.is_set():
        raise KeyboardInterrupt


def clear_interrupt() -> None:
    """Forget an interrupt recorded by :func:`interrupt_handler` (before a run installs the handler)."""
    _interrupted.clear()
