"""
Peak memory of a benchmark run and of the processes it started (VecEnv workers), as proportional set size (PSS).

Summing resident set sizes over processes counts every shared page (libraries, pages shared after a fork) once per
process; PSS splits each shared page among the processes mapping it, so the sum over the tree is the RAM the run
holds. ``RUSAGE_CHILDREN`` is not used: it reports a helper that was forked and exec'd with its parent's whole
size at the fork.
"""

from __future__ import annotations

import os
import threading
from typing import Any


def descendants(pid: int) -> list[int]:
    """:return: the live descendants of ``pid`` (Linux ``/proc``; empty elsewhere)"""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, stack = [], list(children.get(pid, []))
    while stack:
        child = stack.pop()
        found.append(child)
        stack.extend(children.get(child, []))
    return found


def _field_kb(path: str, name: str) -> int | None:
    try:
        with open(path) as f:
            return next((int(line.split()[1]) for line in f if line.startswith(name)), None)
    except OSError:
        return None


def process_pss_mb(pid: int) -> float:
    """:return: the process's proportional set size in MB (its resident size where PSS is not available; 0 if gone)"""
    kb = _field_kb(f"/proc/{pid}/smaps_rollup", "Pss:")
    if kb is None:
        kb = _field_kb(f"/proc/{pid}/status", "VmRSS:") or 0
    return kb / 1024.0


def tree_pss_mb(pid: int | None = None) -> float:
    """:return: PSS of ``pid`` (default: this process) plus that of its live descendants, in MB"""
    root = os.getpid() if pid is None else pid
    return sum(process_pss_mb(p) for p in [root, *descendants(root)])


class PeakMemory:
    """
    Samples :func:`tree_pss_mb` of this process in a background thread while in a ``with`` block; ``peak_mb`` is the
    largest sample (one is also taken on entry and on exit).

    :param interval_s: seconds between samples
    """

    def __init__(self, interval_s: float = 0.25) -> None:
        self.interval_s = interval_s
        self.peak_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="peak-memory", daemon=True)

    def sample(self) -> None:
        """Take one sample now."""
        self.peak_mb = max(self.peak_mb, tree_pss_mb())

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def __enter__(self) -> PeakMemory:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()
