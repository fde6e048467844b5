"""
A forked helper process that serves commands from a ring in shared memory: the other half of the split PPO update
(:mod:`sb3_speedups.ppo.split_update`).

Both processes poll the ring, so a hand-over costs well under a microsecond; after a short spin without commands the
helper sleeps on a pipe and uses no CPU, so it does not compete with the environments between ``train()`` calls. The
helper never outlives the training process (``PR_SET_PDEATHSIG``), ignores SIGINT/SIGTERM (the training process
decides when to stop), and reports its own errors; a helper that dies makes the next wait raise :class:`HelperError`
instead of hanging.
"""

from __future__ import annotations

import ctypes
import gc
import os
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch as th

from sb3_speedups.common.nn.flat import shared_zeros

# Slots of the control block (int64): commands written by the training process, commands done by the helper, the
# helper's status, and whether it sleeps on its pipe.
_WRITTEN, _DONE, _STATUS, _SLEEPING = range(4)
_FAILED = 1
# Command ring: rows of float64 ``[code, arguments...]``.
_RING, _ROW = 8, 8
# The helper polls for this long after its last command before it sleeps on its pipe (seconds): longer than any gap
# between two commands of one train(), shorter than a rollout.
_SPIN_SECONDS = 0.002
# While asleep it wakes this often to check that its parent is alive (a missed wake-up byte costs at most this).
_SLEEP_SECONDS = 0.01
_ERROR_BYTES = 4096
_PR_SET_PDEATHSIG = 1
_DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM}


#: runs one command in the helper process: ``(code, ring row)``, the arguments in ``row[1:]``
Serve = Callable[[int, np.ndarray], None]


class HelperError(RuntimeError):
    """The helper process failed or died."""


@dataclass
class CommandChannel:
    """The control block (int64 slots) and the command ring (float64 rows ``[code, arguments...]``), shared."""

    ctrl: np.ndarray
    ring: np.ndarray
    error: np.ndarray

    @classmethod
    def allocate(cls) -> CommandChannel:
        """:return: a zeroed channel in shared memory (make it before the fork)"""
        return cls(
            shared_zeros(8, th.int64).numpy(),
            shared_zeros(_RING * _ROW, th.float64).numpy().reshape(_RING, _ROW),
            shared_zeros(_ERROR_BYTES, th.uint8).numpy(),
        )


def _kill(pid: int, fds: tuple[int, ...]) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class HelperProcess:
    """
    The forked helper process and the training process's end of the hand-over.

    :param serve: runs one command in the helper process: ``serve(code, row)`` with ``row[1:]`` the arguments
    :param channel: the control block and command ring (made before the fork, so both processes share them)
    """

    def __init__(self, serve: Serve, channel: CommandChannel) -> None:
        self.channel = channel
        self.written = 0
        parent = os.getpid()
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        sys.stdout.flush()
        sys.stderr.flush()
        # A Ctrl-C or SIGTERM whose Python handler ran inside the after-fork hooks (logging registers some) would be
        # swallowed there ("Exception ignored in ..."): the signals wait until the helper is set up, then arrive here.
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, _DEFERRED_SIGNALS)
        try:
            pid = os.fork()
            if pid == 0:  # the helper: never returns
                _serve_forever(serve, channel, read_fd, parent)
            os.close(read_fd)
            self.pid, self.write_fd = pid, write_fd
            self.exit_status: int | None = None
            self._finalizer = weakref.finalize(self, _kill, pid, (write_fd,))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def post(self, code: int, *args: float, wake: bool = False) -> int:
        """Queue a command; :return: the count of commands the helper must have done for this one to be done"""
        ctrl = self.channel.ctrl
        if self.written - ctrl[_DONE] >= _RING:
            self.wait(self.written - _RING + 1)
        row = self.channel.ring[self.written % _RING]
        row[0] = code
        for i, value in enumerate(args, 1):  # item by item: cheaper than numpy converting the tuple
            row[i] = value
        self.written += 1
        ctrl[_WRITTEN] = self.written
        if wake or ctrl[_SLEEPING]:
            try:
                os.write(self.write_fd, b"w")
            except BlockingIOError:  # the pipe is full of wake-ups: the helper is awake anyway
                pass
        return self.written

    def wait(self, done: int) -> None:
        """Return once the helper has done ``done`` commands; raise :class:`HelperError` if it failed or died."""
        ctrl = self.channel.ctrl
        spins = 0
        while ctrl[_DONE] < done:
            spins += 1
            if spins & 4095 == 0:
                self.check()

    def idle(self) -> None:
        """Wait until the helper has done every command posted."""
        self.wait(self.written)

    def check(self) -> None:
        """Raise :class:`HelperError` if the helper reported an error or is gone."""
        if self.channel.ctrl[_STATUS] == _FAILED:
            message = bytes(self.channel.error).rstrip(b"\0").decode(errors="replace")
            self.stop()
            raise HelperError(f"the PPO update's helper process failed: {message}")
        if self.exit_status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid == 0:
                return
            self.exit_status = status
            self._finalizer.detach()
            os.close(self.write_fd)
        code = os.waitstatus_to_exitcode(self.exit_status)
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        raise HelperError(
            f"the PPO update's helper process (pid {self.pid}) {how}; train with split_update=False to run the "
            "update in one process"
        )

    def alive(self) -> bool:
        """:return: whether the helper still runs"""
        try:
            self.check()
        except HelperError:
            return False
        return True

    def stop(self) -> None:
        """Kill the helper (it holds no state of its own) and reap it."""
        self._finalizer()


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this libc: the sleep loop still checks the parent
        pass
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)


def _serve_forever(serve: Serve, channel: CommandChannel, read_fd: int, parent: int) -> None:
    """The helper process's whole life: serve commands until killed."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _die_with_parent(parent)
        # The inherited heap is the parent's: a collection would walk it and copy its pages.
        gc.disable()
        with th.inference_mode():
            _serve(serve, channel, read_fd, parent)
    except BaseException as exc:  # reported to the training process, which raises it
        code = 1
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text = " ".join("".join(traceback.format_exception_only(exc)).split())
        message = f"{text} (at {where.filename}:{where.lineno})".encode()[: _ERROR_BYTES - 1]
        channel.error[: len(message)] = np.frombuffer(message, dtype=np.uint8)
        channel.ctrl[_STATUS] = _FAILED
    finally:
        os._exit(code)


def _serve(serve: Serve, channel: CommandChannel, read_fd: int, parent: int) -> None:
    ctrl, ring = channel.ctrl, channel.ring
    done = int(ctrl[_DONE])
    while True:
        if ctrl[_WRITTEN] == done:
            deadline = time.perf_counter() + _SPIN_SECONDS
            spins = 0
            while ctrl[_WRITTEN] == done:
                spins += 1
                if spins & 1023 == 0 and time.perf_counter() > deadline:
                    _sleep(ctrl, done, read_fd, parent)
                    deadline = time.perf_counter() + _SPIN_SECONDS
        row = ring[done % _RING]
        serve(int(row[0]), row)
        done += 1
        ctrl[_DONE] = done


def _sleep(ctrl: np.ndarray, done: int, read_fd: int, parent: int) -> None:
    ctrl[_SLEEPING] = 1
    while ctrl[_WRITTEN] == done:
        select.select([read_fd], [], [], _SLEEP_SECONDS)
        try:
            os.read(read_fd, 4096)
        except BlockingIOError:
            pass
        if os.getppid() != parent:
            os._exit(0)
    ctrl[_SLEEPING] = 0


@contextmanager
def deferred_sigint() -> Iterator[list[int]]:
    """
    Hold back Ctrl-C (SIGINT with Python's default handler, in the main thread) until the block ends, so that it
    never lands between the two processes' halves of a minibatch; the block may poll the yielded list (non-empty
    once a SIGINT came) to stop early. ``KeyboardInterrupt`` is raised after the block.
    """
    in_main_thread = threading.current_thread() is threading.main_thread()
    if not in_main_thread or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield []
        return
    hits: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: hits.append(signum))
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, previous)
    if hits:
        raise KeyboardInterrupt
