"""
The worker processes of a :class:`~sb3_speedups.common.vec_env.batched_subproc.BatchedSubprocVecEnv` seen from
the main process: starting them, pipe requests and replies, step hand-off and collection, fault detection
(a dead worker is noticed within ``POLL_S`` seconds of any wait), and teardown.
"""

from __future__ import annotations

import ast
import pickle
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np

from sb3_speedups.common.vec_env.env_group import ErrorRecord, InfoRecord
from sb3_speedups.common.vec_env.info_codec import InfoDecoder
from sb3_speedups.common.vec_env.worker import (
    ACTION_DTYPE,
    ACTIONS_ON_PIPE,
    CMD,
    CONTROL_SLOTS,
    ERROR,
    PAYLOAD_LEN,
    PAYLOAD_ON_PIPE,
    PIPE,
    POLL_S,
    STATUS,
    STEP,
    burn,
    wait_for,
    worker_main,
)


def unguarded_main_script() -> str | None:
    """
    :return: the path of the main script when it has no top-level ``if __name__ == "__main__":`` (spawn and
        forkserver children run it again as they start), else ``None``
    """
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if path is None:
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            sides = [test.left, test.comparators[0]]
            names = {s.id for s in sides if isinstance(s, ast.Name)} | {s.value for s in sides if isinstance(s, ast.Constant)}
            if names == {"__name__", "__main__"}:
                return None
    return str(path)


class WorkerDiedError(RuntimeError):
    """A worker process of a :class:`BatchedSubprocVecEnv` exited or was killed; the VecEnv must be recreated."""


class RemoteTraceback(Exception):
    """Carries a worker's traceback text; set as ``__cause__`` of the exception re-raised in the main process."""

    def __str__(self) -> str:
        return "\n" + str(self.args[0])


def reraise(record: ErrorRecord) -> None:
    """
    Raise, in the main process, the exception a worker caught (its own type when it could be pickled).

    :param record: ``(exception or None, "Type: message", traceback text)``
    """
    exc, summary, text = record
    try:
        raise (exc if exc is not None else RuntimeError(summary)) from RemoteTraceback(text)
    finally:
        # No frame -> exception -> traceback -> frame cycle: it would keep the workers' semaphores alive.
        exc = record = None  # type: ignore[assignment]


def unlink_semaphore_names(semaphores: list[Any]) -> None:
    """
    Remove the /dev/shm names of semaphores that every process has opened already (spawn and forkserver
    name them so children can open them; fork needs no names). Runs multiprocessing's own clean-up now
    instead of at garbage collection, so no name is left behind even if this process is killed later.

    :param semaphores: multiprocessing semaphores
    """
    from multiprocessing import synchronize, util

    names = {sem._semlock.name for sem in semaphores if getattr(sem._semlock, "name", None)}
    if not names:
        return
    registry = getattr(util, "_finalizer_registry", {})
    for finalizer in list(registry.values()):
        callback, args = getattr(finalizer, "_callback", None), getattr(finalizer, "_args", ())
        if callback is synchronize.SemLock._cleanup and args and args[0] in names:  # type: ignore[attr-defined]
            finalizer()


@dataclass(eq=False)
class WorkerHandle:
    """The main process's view of one worker: its process, pipe, semaphores, envs and shared rows."""

    index: int
    process: Any
    conn: Connection
    go: Any
    done: Any
    first: int = 0
    stop: int = 0
    control: np.ndarray = field(default_factory=lambda: np.zeros(CONTROL_SLOTS, dtype=np.int64))
    payload: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.uint8))
    attached: bool = False
    pending: bool = False
    info_decoder: InfoDecoder = field(default_factory=InfoDecoder)


class WorkerPool:
    """
    :param ctx: multiprocessing context (start method)
    :param spin_s: spin budget before blocking, in seconds
    """

    def __init__(self, ctx: Any, spin_s: float) -> None:
        self.ctx = ctx
        self.spin_s = spin_s
        self.workers: list[WorkerHandle] = []
        self.broken: str | None = None

    def start(self, n_workers: int) -> None:
        """:param n_workers: processes to start (they boot while the main process goes on)"""
        for index in range(n_workers):
            parent_conn, child_conn = self.ctx.Pipe()
            go, done = self.ctx.Semaphore(0), self.ctx.Semaphore(0)
            process = self.ctx.Process(
                target=worker_main,
                args=(index, child_conn, go, done, self.spin_s),
                daemon=True,
                name=f"vecenv-worker-{index}",
            )
            process.start()
            child_conn.close()
            self.workers.append(WorkerHandle(index, process, parent_conn, go, done))

    def rehearse(self, steps: list[tuple[int, int | None]]) -> list[float]:
        """
        Time synthetic steps: the main process burns ``main_units`` of work while every worker burns
        ``worker_units`` (``None``: the workers sit that step out), as in a real step with that split.

        :param steps: ``(main_units, worker_units)`` per step
        :return: seconds of each step
        """
        self.request_all("rehearse", [units for _, units in steps if units is not None])
        self.replies(self.workers)
        times = []
        for main_units, worker_units in steps:
            start = perf_counter()
            if worker_units is not None:
                for worker in self.workers:
                    worker.go.release()
            burn(main_units)
            if worker_units is not None:
                for worker in self.workers:
                    wait_for(worker.done, self.spin_s, lambda w=worker: self.check_alive(w, "start-up"))  # type: ignore[misc]
            times.append(perf_counter() - start)
        self.replies(self.workers)
        return times

    # --- pipe commands --------------------------------------------------------------------------------------
    def request(self, worker: WorkerHandle, name: str, data: Any) -> None:
        """Send a pipe command (and, once the worker serves shared memory, wake it up for it)."""
        worker.conn.send((name, data))
        if worker.attached:
            worker.control[CMD] = PIPE
            worker.go.release()

    def request_all(self, name: str, data: Any) -> None:
        """Send the same pipe command to every worker."""
        for worker in self.workers:
            self.request(worker, name, data)

    def reply(self, worker: WorkerHandle) -> Any:
        """:return: the worker's answer to its last pipe command (its error re-raised here)"""
        while not worker.conn.poll(POLL_S):
            self.check_alive(worker, "a command")
        try:
            status, result = worker.conn.recv()
        except (EOFError, ConnectionResetError):
            self.check_alive(worker, "a command", wait_s=2.0)
            raise
        if status == "error":
            try:
                reraise(result)
            finally:
                result = None
        return result

    def replies(self, workers: Sequence[WorkerHandle]) -> list[Any]:
        """Read one reply from each worker, then raise the first error among them, if any."""
        results, error = [], None
        for worker in workers:
            try:
                results.append(self.reply(worker))
            except WorkerDiedError:
                raise
            except Exception as exc:
                error = error or exc
                results.append(None)
        if error is not None:
            try:
                raise error
            finally:
                error = None
        return results

    def replies_quietly(self, workers: Sequence[WorkerHandle]) -> None:
        """Read the replies while the caller raises an error of its own (a dead worker still raises)."""
        try:
            self.replies(workers)
        except WorkerDiedError:
            raise
        except Exception:  # the caller is already raising an error of its own
            pass

    def check_alive(self, worker: WorkerHandle, during: str, wait_s: float = 0.0) -> None:
        """Raise :class:`WorkerDiedError` (and mark the pool broken) if ``worker`` has exited."""
        worker.process.join(wait_s)
        code = worker.process.exitcode
        if code is None:
            return
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        self.broken = (
            f"BatchedSubprocVecEnv worker {worker.index} (envs {worker.first}-{worker.stop - 1}, "
            f"pid {worker.process.pid}) {how} during {during}; close this VecEnv and create a new one"
        )
        script = unguarded_main_script() if code > 0 and not worker.attached else None
        method = self.ctx.get_start_method()
        if script is not None and method != "fork":
            self.broken = (
                f"BatchedSubprocVecEnv worker {worker.index} exited during start-up: the {method} start method re-imports "
                f"the main script {script}, which has no 'if __name__ == \"__main__\":' guard, so the worker ran the "
                "script's own VecEnv creation again and failed; put the script's code under that guard, or pass "
                'start_method="fork"'
            )
        raise WorkerDiedError(self.broken)

    # --- steps ----------------------------------------------------------------------------------------------
    def start_step(self, workers: Sequence[WorkerHandle], code: int, actions_by_index: dict[int, Any] | None) -> None:
        """
        Wake ``workers`` up for a step whose actions are already in shared memory (``code``: their dtype), or,
        with ``code == ACTIONS_ON_PIPE``, sent here through the pipe (``actions_by_index``).
        """
        for worker in workers:
            worker.control[CMD] = STEP
            worker.control[ACTION_DTYPE] = code
            if code == ACTIONS_ON_PIPE:
                assert actions_by_index is not None
                worker.conn.send({i: a for i, a in actions_by_index.items() if worker.first <= i < worker.stop})
            worker.pending = True
            worker.go.release()

    def collect(self, workers: Sequence[WorkerHandle]) -> list[InfoRecord]:
        """Wait for every given worker's step, then return their info records (or raise the first error)."""
        records: list[InfoRecord] = []
        error = None
        for worker in workers:
            wait_for(worker.done, self.spin_s, lambda w=worker: self.check_alive(w, "step"))  # type: ignore[misc]
            worker.pending = False
            length = int(worker.control[PAYLOAD_LEN])
            if length == 0:
                continue
            data = worker.conn.recv_bytes() if length == PAYLOAD_ON_PIPE else worker.payload[:length].data
            if worker.control[STATUS] == ERROR:
                error = error or pickle.loads(data)
            else:
                records.extend(worker.info_decoder.decode(data))
        if error is not None:
            try:
                reraise(error)
            finally:
                error = None
        return records

    def finish_quietly(self, workers: Sequence[WorkerHandle]) -> None:
        """Wait for the steps of ``workers``, dropping their results and errors (a dead worker still raises)."""
        try:
            self.collect(workers)
        except WorkerDiedError:
            raise
        except Exception:  # the error of a step whose caller is already handling another one
            pass

    # --- shutdown -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Ask every worker to close its envs and exit."""
        self.request_all("close", None)
        self.replies(self.workers)

    def abandon(self) -> None:
        """Tell every worker to exit now, without waiting for answers (start-up failed, or a worker died)."""
        for worker in self.workers:
            try:
                self.request(worker, "close", None)
            except OSError:  # that worker is gone already
                pass

    def teardown(self) -> None:
        """Reap the processes (killing any that does not exit) and close the pipes."""
        for worker in self.workers:
            worker.process.join(2.0)
            if worker.process.exitcode is None:
                worker.process.kill()
                worker.process.join(2.0)
            worker.conn.close()
        self.workers = []
