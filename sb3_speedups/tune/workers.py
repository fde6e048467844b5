"""
Processes of a tuning run.

- Worker processes (``--n-jobs``): each runs Optuna trials against the shared storage; a shared counter of trial
  slots makes the workers of one run stop at exactly ``--n-trials``.
- Seed helpers (``--trial-seeds K``): each worker keeps ``K - 1`` helper processes that train the other seeds of
  its trial in lockstep with its own: after every evaluation the worker gathers all K returns, reports the mean
  to Optuna and tells every seed whether to go on, so pruning acts on the mean.

All processes are started with ``spawn`` (safe with torch and with threads of the storage drivers).
"""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

from sb3_speedups.tune.training import SeedResult, TrialJob, train_seed

_CONTEXT = multiprocessing.get_context("spawn")
JOIN_TIMEOUT_S = 60.0
# Exit code of a worker stopped by SIGINT/SIGTERM (as a shell reports a process ended by Ctrl-C).
INTERRUPTED_EXIT_CODE = 130


class SeedFailed(RuntimeError):
    """Another seed of the trial raised; the message names the seed and its error."""


def describe_error(exc: BaseException) -> str:
    """:return: one line: the exception type and the first line of its message"""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _helper_main(conn: Connection) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the worker, which ends its helpers
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "quit":
            return
        if message[0] != "job":
            continue  # a decision meant for a trial that already ended
        _, token, job, seed = message

        def report(index: int, value: float, token: int = token) -> bool:
            conn.send(("eval", token, index, value))
            while True:
                reply = conn.recv()
                if reply[0] == "quit":
                    raise SystemExit(0)
                if reply[0] == "decide" and reply[1] == token:
                    return bool(reply[2])

        try:
            result = train_seed(job, seed, report)
        except Exception as exc:
            conn.send(("error", token, describe_error(exc)))
        else:
            conn.send(("done", token, result))


class SeedGroup:
    """
    Trains the seeds of a trial: the first in this process, the others in persistent helper processes.

    :param n_helpers: helper processes (``trial_seeds - 1``)
    """

    def __init__(self, n_helpers: int) -> None:
        self.n_helpers = n_helpers
        self._conns: list[Connection | None] = [None] * n_helpers
        self._procs: list[Any] = [None] * n_helpers
        self._token = 0

    def _start(self, i: int) -> Connection:
        parent, child = _CONTEXT.Pipe()
        proc = _CONTEXT.Process(target=_helper_main, args=(child,), daemon=True, name=f"sb3-speedups-seed-{i + 1}")
        proc.start()
        child.close()
        self._conns[i], self._procs[i] = parent, proc
        return parent

    def _conn(self, i: int) -> Connection:
        conn, proc = self._conns[i], self._procs[i]
        if conn is None or proc is None or not proc.is_alive():
            self._stop(i)
            conn = self._start(i)
        return conn

    def _recv(self, i: int, kinds: Sequence[str]) -> tuple:
        conn = self._conns[i]
        assert conn is not None
        while True:
            message = conn.recv()
            if message[1] == self._token and message[0] in kinds:
                return message

    def run(self, job: TrialJob, seeds: list[int], report: Callable[[int, list[float]], bool]) -> list[SeedResult]:
        """
        :param job: the trial
        :param seeds: one seed per process (``n_helpers + 1``)
        :param report: receives (evaluation number, returns of all seeds) and says whether to go on
        :return: each seed's evaluation returns
        """
        self._token += 1
        conns = [self._conn(i) for i in range(self.n_helpers)]
        for conn, seed in zip(conns, seeds[1:], strict=True):
            conn.send(("job", self._token, job, seed))
        running = [True] * self.n_helpers

        def report_all(index: int, own: float) -> bool:
            values = [own]
            for i in range(self.n_helpers):
                message = self._recv(i, ("eval", "done", "error"))
                if message[0] != "eval":
                    running[i] = False
                    detail = message[2] if message[0] == "error" else "it ended before the others"
                    raise SeedFailed(f"seed {seeds[i + 1]} failed: {detail}")
                values.append(message[3])
            keep = report(index, values)
            for conn in conns:
                conn.send(("decide", self._token, keep))
            return keep

        try:
            results = [train_seed(job, seeds[0], report_all)]
            for i in range(self.n_helpers):
                message = self._recv(i, ("done", "error"))
                running[i] = False
                if message[0] == "error":
                    raise SeedFailed(f"seed {seeds[i + 1]} failed: {message[2]}")
                results.append(message[2])
            return results
        except KeyboardInterrupt:
            self.close()
            raise
        finally:
            for i in range(self.n_helpers):
                if running[i]:
                    self._drain(i)

    def _drain(self, i: int) -> None:
        """Tell a helper still training to stop, and wait until it is ready for the next trial."""
        try:
            conn = self._conns[i]
            if conn is None:
                return
            conn.send(("decide", self._token, False))
            self._recv(i, ("done", "error"))
        except (EOFError, OSError):
            self._stop(i)

    def _stop(self, i: int) -> None:
        conn, proc = self._conns[i], self._procs[i]
        if conn is not None:
            try:
                conn.send(("quit",))
            except (OSError, ValueError):
                pass
            conn.close()
        if proc is not None:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        self._conns[i], self._procs[i] = None, None

    def close(self) -> None:
        """End the helper processes."""
        for i in range(self.n_helpers):
            proc = self._procs[i]
            if proc is not None and proc.is_alive():
                proc.terminate()
            self._stop(i)


class TrialSlots:
    """
    Trials this run may still start, shared by its worker processes.

    :param count: the number of slots
    :param shared: keep the counter in shared memory (for worker processes)
    """

    def __init__(self, count: int, shared: bool = False) -> None:
        self._value: Any = _CONTEXT.Value("i", max(count, 0)) if shared else max(count, 0)

    def take(self) -> bool:
        """:return: whether a slot was left (and is now taken)"""
        if isinstance(self._value, int):
            if self._value <= 0:
                return False
            self._value -= 1
            return True
        with self._value.get_lock():
            if self._value.value <= 0:
                return False
            self._value.value -= 1
            return True


def run_worker_processes(n_jobs: int, target: Callable[..., None], args: tuple) -> list[int]:
    """
    Start ``n_jobs`` processes of ``target(worker_index, *args)`` and wait for them. On ``KeyboardInterrupt``
    (Ctrl-C, or SIGTERM turned into one) the workers are sent SIGTERM, so each marks its running trial failed,
    and are waited for before the interrupt goes on.

    :param n_jobs: number of processes
    :param target: an importable function
    :param args: its arguments after the worker index (picklable)
    :return: the exit codes
    """
    procs = [_CONTEXT.Process(target=target, args=(i, *args), name=f"sb3-speedups-tune-{i}") for i in range(n_jobs)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join()
    except KeyboardInterrupt:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout=JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()
        raise
    return [int(proc.exitcode or 0) for proc in procs]
