"""
The worker process of :class:`~sb3_speedups.common.vec_env.batched_subproc.BatchedSubprocVecEnv`.

Hot path: the main process writes the actions into shared memory, sets the command code in the worker's control
row and releases the worker's ``go`` semaphore; the worker steps its envs into the shared arrays, writes the
pickled infos (if any) into its payload row and releases ``done``. Everything else (reset, attributes, methods,
images, set-up) goes through the worker's pipe. Both sides wait with a short bounded spin, then block.
"""

from __future__ import annotations

import os
import pickle
import signal
from collections.abc import Callable
from functools import partial
from multiprocessing import parent_process, reduction
from multiprocessing.connection import Connection
from time import perf_counter
from typing import Any

import cloudpickle
import numpy as np

from sb3_speedups.common.vec_env.env_group import ENV_COMMANDS, EnvGroup, error_record, make_envs, obs_keys
from sb3_speedups.common.vec_env.info_codec import InfoEncoder
from sb3_speedups.common.vec_env.shared_memory import ArraySpec, SharedArrays

# Control row of each worker (int64 slots)
CMD, ACTION_DTYPE, STATUS, PAYLOAD_LEN = range(4)
CONTROL_SLOTS = 4
# Commands (CMD slot): a step, or a message waiting in the pipe
STEP, PIPE = 1, 2
# Replies (STATUS slot)
OK, ERROR = 0, 1
# PAYLOAD_LEN when the payload did not fit in the payload row and was sent through the pipe instead
PAYLOAD_ON_PIPE = -1
# ACTION_DTYPE: index into ACTION_DTYPES, or ACTIONS_ON_PIPE for actions that shared memory cannot carry
ACTION_DTYPES: tuple[np.dtype, ...] = tuple(
    np.dtype(name) for name in ("?", "i1", "u1", "i2", "u2", "i4", "u4", "i8", "u8", "f2", "f4", "f8")
)
ACTIONS_ON_PIPE = -1
ACTION_ITEM_BYTES = 8  # the widest ACTION_DTYPES item: the actions array is sized for it

sched_yield = getattr(os, "sched_yield", lambda: None)

POLL_S = 0.2  # blocking waits wake up this often to check that the other side is alive


def wait_for(sem: Any, spin_s: float, on_timeout: Callable[[], None]) -> None:
    """
    Acquire ``sem``: spin for at most ``spin_s`` seconds (cheap when the other side is about to answer), then
    block, calling ``on_timeout`` (which raises if the other side is gone) every ``POLL_S`` seconds.

    :param sem: a multiprocessing semaphore
    :param spin_s: spin budget in seconds
    :param on_timeout: called after each blocking timeout
    """
    if sem.acquire(False):
        return
    deadline = perf_counter() + spin_s
    while perf_counter() < deadline:
        # Yield while spinning: on a busy machine the process we wait for may be queued on this very core.
        sched_yield()
        if sem.acquire(False):
            return
    while not sem.acquire(True, POLL_S):
        on_timeout()


def burn(units: int) -> int:
    """
    Fixed CPU work (unlike sleeping or spinning on the clock, it takes longer when the process is descheduled).

    :param units: amount of work
    :return: a value that depends on the work, so it cannot be skipped
    """
    total = 0
    for i in range(units):
        total += i
    return total


class _ParentGone(Exception):
    pass


class Worker:
    """
    State and command handlers of one worker process.

    :param index: worker index
    :param conn: the worker's end of its pipe
    :param go: released by the main process when a command is ready
    :param done: released by the worker when its reply is ready
    :param spin_s: spin budget before blocking, in seconds
    """

    def __init__(self, index: int, conn: Connection, go: Any, done: Any, spin_s: float) -> None:
        self.index = index
        self.conn = conn
        self.go = go
        self.done = done
        self.spin_s = spin_s
        self.where = f"worker {index} (pid {os.getpid()})"
        self.parent = parent_process()
        self.envs: list[Any] = []
        self.first = 0
        self.group: EnvGroup | None = None
        self.shared: SharedArrays | None = None
        self.control = np.zeros(CONTROL_SLOTS, dtype=np.int64)
        self.payload = np.zeros(0, dtype=np.uint8)
        self.active = np.zeros(0, dtype=bool)
        self.action_views: dict[int, np.ndarray] = {}
        self.action_shape: tuple[int, ...] = ()
        self.info_encoder = InfoEncoder()
        self.pipe_handlers: dict[str, Callable[[Any], Any]] = {
            "rehearse": self._rehearse,
            "make_envs": self._make_envs,
            "attach": self._attach,
            "get_spaces": lambda _: (self.envs[0].observation_space, self.envs[0].action_space),
            "reset": self._reset,
            "close": self._close_envs,
        }
        for name in ENV_COMMANDS:
            self.pipe_handlers[name] = partial(self._env_command, name)
        self.commands: dict[int, Callable[[], bool]] = {STEP: self._step, PIPE: self._pipe_command}

    def _check_parent(self) -> None:
        if self.parent is not None and not self.parent.is_alive():
            raise _ParentGone

    def run(self) -> None:
        """Serve pipe commands until attached to shared memory, then serve commands signalled by ``go``."""
        try:
            while self.shared is None:
                while not self.conn.poll(1.0):
                    self._check_parent()
                if not self._pipe_command():
                    return
            while True:
                wait_for(self.go, self.spin_s, self._check_parent)
                if not self.commands[int(self.control[CMD])]():
                    return
        except (_ParentGone, EOFError, BrokenPipeError, ConnectionResetError):
            self._close_envs(None)

    # --- hot path -------------------------------------------------------------------------------------------
    def _step(self) -> bool:
        assert self.group is not None
        code = int(self.control[ACTION_DTYPE])
        try:
            if code == ACTIONS_ON_PIPE:
                actions = self.conn.recv()
            else:
                view = self.action_views.get(code)
                if view is None:
                    view = self.action_views[code] = self._action_view(code)
                # A private copy, as the caller's array is for DummyVecEnv: an env may keep its action.
                actions = view.copy()
            records = self.group.step(actions, self.active)
            self.control[STATUS] = OK
            self._send_payload(self.info_encoder.encode(records) if records else b"")
        except Exception as exc:
            self.control[STATUS] = ERROR
            self._send_payload(pickle.dumps(error_record(exc), protocol=pickle.HIGHEST_PROTOCOL))
        self.done.release()
        return True

    def _action_view(self, code: int) -> np.ndarray:
        assert self.shared is not None
        return self.shared.view("actions", ACTION_DTYPES[code], (len(self.active), *self.action_shape))

    def _send_payload(self, data: bytes) -> None:
        if len(data) <= len(self.payload):
            self.payload[: len(data)] = np.frombuffer(data, dtype=np.uint8)
            self.control[PAYLOAD_LEN] = len(data)
        else:
            self.control[PAYLOAD_LEN] = PAYLOAD_ON_PIPE
            self.conn.send_bytes(data)

    # --- pipe commands --------------------------------------------------------------------------------------
    def _pipe_command(self) -> bool:
        name, data = self.conn.recv()
        try:
            reply = ("ok", self.pipe_handlers[name](data))
        except _Answered:
            return True
        except Exception as exc:
            reply = ("error", error_record(exc))
        try:
            self.conn.send(reply)
        except OSError:
            raise
        except Exception as exc:  # a result that cannot be pickled (an attribute, a method's return value)
            self.conn.send(("error", error_record(exc)))
        return name != "close"

    def _targets(self, indices: list[int]) -> list[Any]:
        return [self.envs[i - self.first] for i in indices]

    def _rehearse(self, work: list[int]) -> None:
        # Answer first, then for each entry: wait for ``go``, burn that many work units, release ``done``; the main
        # process times these synthetic steps to choose how many envs it steps itself.
        self.conn.send(("ok", None))
        for units in work:
            wait_for(self.go, self.spin_s, self._check_parent)
            burn(units)
            self.done.release()
        self.conn.send(("ok", None))
        raise _Answered

    def _make_envs(self, data: tuple[int, bytes]) -> None:
        self.first, fns_bytes = data
        self.envs = make_envs(cloudpickle.loads(fns_bytes), self.first, self.where)

    def _attach(self, data: tuple[list[ArraySpec], Any, tuple[int, ...]]) -> None:
        specs, observation_space, self.action_shape = data
        self.shared = SharedArrays(specs, fd=reduction.recv_handle(self.conn))
        arrays = self.shared.arrays
        self.control = arrays["control"][self.index]
        self.payload = arrays["payload"][self.index]
        self.active = arrays["active"]
        obs_arrays = [(key, arrays[name]) for key, name in obs_keys(observation_space)]
        self.group = EnvGroup(self.envs, self.first, obs_arrays, arrays["rewards"], arrays["dones"], self.where)

    def _reset(self, data: tuple[list[int | None], list[dict[str, Any]]]) -> list[dict[str, Any]]:
        assert self.group is not None
        return self.group.reset(*data)

    def _env_command(self, name: str, data: tuple[tuple[Any, ...], list[int]]) -> list[Any]:
        args, indices = data  # the command's arguments, VecEnv indices of the envs to run it on
        return ENV_COMMANDS[name](self._targets(indices), args)

    def _close_envs(self, _: Any) -> None:
        envs, self.envs = self.envs, []
        for env in envs:
            try:
                env.close()
            except Exception:  # closing must go on for the other envs; the main process is tearing down anyway
                pass


class _Answered(Exception):
    """Raised by a handler that already sent its own replies."""


def worker_main(index: int, conn: Connection, go: Any, done: Any, spin_s: float) -> None:
    """
    Entry point of a worker process.

    :param index: worker index
    :param conn: the worker's end of its pipe
    :param go: command semaphore
    :param done: reply semaphore
    :param spin_s: spin budget before blocking, in seconds
    """
    # Ctrl+C goes to the whole process group: let the main process handle it and close us cleanly.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    Worker(index, conn, go, done, spin_s).run()
