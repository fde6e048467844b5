"""
PPO's minibatch update on two CPU cores: the actor's half in the training process, the critic's half in a forked
helper process, side by side.

With separate policy and value networks (SB3's default for ``MlpPolicy``) the two halves of the loss touch disjoint
parameters: the clipped surrogate and the entropy only the actor's, the value loss only the critic's. Only the
gradient clipping couples them (one norm over all gradients). So each minibatch runs as: the helper computes the
critic's forward and backward while the training process computes the actor's; the training process then takes the
norm of the whole gradient (the same reduction over the same buffer as in one process), and each process takes the
Adam step of its own parameters (element-wise, so the same numbers). Parameters, gradients and Adam moments live in
shared memory (:func:`~sb3_speedups.common.nn.optim.shared_zeros`); the processes hand over work through a small
command ring in shared memory that both poll, so a hand-over costs well under a microsecond. Between ``train()``
calls the helper sleeps on a pipe and uses no CPU, so it does not compete with the environments.

The helper never outlives the training process (``PR_SET_PDEATHSIG``), ignores SIGINT/SIGTERM (the training process
decides when to stop), and reports its own errors; a helper that dies makes the next wait raise
:class:`HelperError` instead of hanging.
"""

from __future__ import annotations

import ctypes
import gc
import math
import os
import select
import signal
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.ppo.minibatches import OLD_VALUES, RETURNS, Minibatch
from sb3_speedups.common.nn.optim import shared_zeros
from sb3_speedups.ppo.update import VALUE_LOSS, ManualPPOUpdate, PPOLossConfig
from sb3_speedups.common.torch_utils import available_cpus

# Slots of the control block (int64): commands written by the training process, commands done by the helper, the
# helper's status, and whether it sleeps on its pipe.
_WRITTEN, _DONE, _STATUS, _SLEEPING = range(4)
_FAILED = 1
# Command ring: rows of float64 ``[code, arguments...]``.
_RING, _ROW = 8, 8
_LOAD, _GATHER, _GRAD, _STEP = 1, 2, 3, 4
# The helper polls for this long after its last command before it sleeps on its pipe (seconds): longer than any gap
# between two commands of one train(), shorter than a rollout.
_SPIN_SECONDS = 0.002
# While asleep it wakes this often to check that its parent is alive (a missed wake-up byte costs at most this).
_SLEEP_SECONDS = 0.01
_ERROR_BYTES = 4096
_PR_SET_PDEATHSIG = 1
_DEFERRED_SIGNALS = {signal.SIGINT, signal.SIGTERM}


def split_unsupported_reason(policy: ActorCriticPolicy, explicit: bool) -> str | None:
    """
    :param policy: a policy the hand-derived update runs
    :param explicit: ``split_update=True`` (the CPU count and torch's thread count are not checked then)
    :return: why the update cannot run split over two processes here, or ``None`` when it can
    """
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "split updates need Linux's fork()"
    if policy.device.type != "cpu":
        return "split updates run on the CPU"
    if explicit:
        return None
    if available_cpus() < 2:
        return "fewer than 2 CPUs"
    if th.get_num_threads() != 1:
        return "torch runs on several threads"
    return None


class HelperError(RuntimeError):
    """The helper process failed or died."""


class _Shared:
    """The shared-memory areas of one helper, sized for one rollout shape."""

    def __init__(self, n: int, obs_dim: int, capacity: int) -> None:
        self.key = (n, obs_dim, capacity)
        self.ctrl = shared_zeros(8, th.int64).numpy()
        self.ring = shared_zeros(_RING * _ROW, th.float64).numpy().reshape(_RING, _ROW)
        self.results = shared_zeros(capacity, th.float64).numpy()
        self.obs = shared_zeros(n * obs_dim).view(n, obs_dim)
        self.scalars = shared_zeros(2 * n).view(2, n)  # old values, returns
        self.index = shared_zeros(n, th.int64)
        self.error = shared_zeros(_ERROR_BYTES, th.uint8).numpy()


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


class _Helper:
    """The forked process and the training process's end of the hand-over."""

    def __init__(self, update: SplitPPOUpdate, shared: _Shared) -> None:
        self.shared = shared
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
                _serve_forever(update, shared, read_fd, parent)
            os.close(read_fd)
            self.pid, self.write_fd = pid, write_fd
            self.exit_status: int | None = None
            self._finalizer = weakref.finalize(self, _kill, pid, (write_fd,))
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def post(self, code: int, *args: float, wake: bool = False) -> int:
        """Queue a command; :return: the count of commands the helper must have done for this one to be done"""
        ctrl = self.shared.ctrl
        if self.written - ctrl[_DONE] >= _RING:
            self.wait(self.written - _RING + 1)
        row = self.shared.ring[self.written % _RING]
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
        ctrl = self.shared.ctrl
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
        if self.shared.ctrl[_STATUS] == _FAILED:
            message = bytes(self.shared.error).rstrip(b"\0").decode(errors="replace")
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


def _serve_forever(update: SplitPPOUpdate, shared: _Shared, read_fd: int, parent: int) -> None:
    """The helper process's whole life: serve commands until killed."""
    code = 0
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _die_with_parent(parent)
        # The inherited heap is the parent's: a collection would walk it and copy its pages.
        gc.disable()
        with th.inference_mode():
            _serve(update, shared, read_fd, parent)
    except BaseException as exc:  # reported to the training process, which raises it
        code = 1
        where = traceback.extract_tb(exc.__traceback__)[-1]
        text = " ".join("".join(traceback.format_exception_only(exc)).split())
        message = f"{text} (at {where.filename}:{where.lineno})".encode()[: _ERROR_BYTES - 1]
        shared.error[: len(message)] = np.frombuffer(message, dtype=np.uint8)
        shared.ctrl[_STATUS] = _FAILED
    finally:
        os._exit(code)


def _serve(update: SplitPPOUpdate, shared: _Shared, read_fd: int, parent: int) -> None:
    ctrl, ring = shared.ctrl, shared.ring
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
        update.serve_command(int(row[0]), row, shared)
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


class SplitPPOUpdate(ManualPPOUpdate):
    """
    :class:`~sb3_speedups.ppo.update.ManualPPOUpdate` with the critic's half of every minibatch computed in a
    forked helper process (see the module's docstring). The same numbers as the one-process update of unstacked
    networks; call :meth:`begin_train`, then per minibatch :meth:`begin_minibatch` before ``forward``, and
    :meth:`end_train` after the last one.

    :param policy: as for :class:`ManualPPOUpdate`
    :param head: the policy's action head
    """

    def __init__(self, policy: ActorCriticPolicy, head: ActionHead) -> None:
        super().__init__(policy, head, split=True)
        self.actor_part = slice(0, self.net.critic_start)
        self.critic_part = slice(self.net.critic_start, self.flat.data.numel())
        self._helper: _Helper | None = None
        self._last_gather = 0  # the command count at which the helper has read the last order handed to it
        self._value_loss_zeroed: set[int] = set()
        # helper side: the epoch's gathered observations and (old values, returns), and views of its minibatches
        self._epoch: tuple[th.Tensor, th.Tensor] | None = None
        self._views: dict[tuple[int, int], tuple[th.Tensor, th.Tensor, th.Tensor]] = {}
        self._cfg: PPOLossConfig | None = None

    # ----- training process ---------------------------------------------------------------------------------------

    def begin_train(self, observations: th.Tensor, scalars: th.Tensor, cfg: PPOLossConfig, rows: int) -> None:
        """
        Start the helper if needed and hand it the rollout.

        :param observations: the sampler's rollout observations ``[n, obs_dim]``
        :param scalars: the sampler's ``[4, n]`` scalars (old values and returns are read)
        :param cfg: the loss's coefficients
        :param rows: the most minibatch updates this ``train()`` can do
        """
        n, obs_dim = observations.shape
        helper = self._helper
        if helper is None or helper.shared.key[:2] != (n, obs_dim) or helper.shared.key[2] < rows or not helper.alive():
            self.close()
            helper = self._helper = _Helper(self, _Shared(n, obs_dim, max(rows, 1)))
            self._last_gather = 0
        shared = helper.shared
        shared.obs.copy_(observations)
        shared.scalars[0].copy_(scalars[OLD_VALUES])
        shared.scalars[1].copy_(scalars[RETURNS])
        clip_vf = math.nan if cfg.clip_range_vf is None else cfg.clip_range_vf
        helper.post(_LOAD, cfg.clip_range, clip_vf, cfg.ent_coef, cfg.vf_coef, cfg.max_grad_norm, wake=True)
        self._adam_step = float(self.adam.steps[0])
        self._hyperparameters = self.adam.hyperparameters()  # nothing changes them during a train()

    def gathered(self, index: th.Tensor) -> None:
        """Tell the helper that the sampler gathered the epoch in the order ``index``."""
        assert self._helper is not None
        self._helper.wait(self._last_gather)  # done long ago in practice: no wait for the helper to wake up
        self._helper.shared.index.copy_(index)
        self._last_gather = self._helper.post(_GATHER)

    def begin_minibatch(self, start: int, end: int, row: int) -> None:
        """Have the helper compute the critic's gradient of the epoch's samples ``start:end`` (stats row ``row``)."""
        assert self._helper is not None
        self._helper.post(_GRAD, start, end, row)

    def forward(self, mb: Minibatch, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """The actor's half of :meth:`ManualPPOUpdate.forward` (the value loss's statistic comes at :meth:`end_train`)."""
        obs = mb.observations
        assert isinstance(obs, th.Tensor)
        n = obs.shape[0]
        ws = self._ws.get(n) or self._workspace(n, obs.device)
        if n not in self._value_loss_zeroed:
            ws["row"][VALUE_LOSS].zero_()
            self._value_loss_zeroed.add(n)
        self._policy_loss(ws, mb, cfg, self.net.forward_part(obs, 0))
        th.mv(ws["rows"], ws["mean_weights"], out=stats)
        self._policy_loss_gradient(ws, n)
        self._pending = (ws, n, cfg.ent_coef)

    def backward(self) -> None:
        """The actor's gradient (the critic's is the helper's)."""
        ws, n, ent_coef = self._pending
        d_out = self.net.d_out_buffer(n)
        self.head.backward(ws["head"], ws["g_log_prob"], -ent_coef / n, d_out, self.net.grad_log_std)
        self.net.backward_part(d_out, 0)

    def optimizer_step(self, max_grad_norm: float) -> None:
        """Wait for the critic's gradient, clip by the norm of both, and step the actor here and the critic there."""
        helper = self._helper
        assert helper is not None
        helper.idle()
        divisor = self.flat.clip_divisor(max_grad_norm)
        lr, beta1, beta2, eps = self._hyperparameters
        self._adam_step += 1
        helper.post(_STEP, 0.0 if divisor is None else float(divisor), lr, beta1, beta2, eps, self._adam_step)
        self.adam.step_range(self.actor_part, divisor, lr, beta1, beta2, eps, self._adam_step)

    def end_train(self, stats: th.Tensor, rows: int) -> None:
        """Wait for the helper's last step and put its value losses into ``stats[:rows]``."""
        assert self._helper is not None
        self._helper.idle()
        self._helper.check()
        stats[:rows, VALUE_LOSS].copy_(th.from_numpy(self._helper.shared.results[:rows]))

    def abandon(self) -> None:
        """After an error mid-train: stop the helper (a fresh one starts with the next ``train()``)."""
        self.close()

    def close(self) -> None:
        """Stop the helper process, if any."""
        if self._helper is not None:
            self._helper.stop()
            self._helper = None

    def helper_pid(self) -> int | None:
        """:return: the helper process's pid while it runs"""
        return None if self._helper is None else self._helper.pid

    # ----- helper process -----------------------------------------------------------------------------------------

    def serve_command(self, code: int, args: np.ndarray, shared: _Shared) -> None:
        """Run one command in the helper process (``args[1:]`` holds the command's arguments)."""
        if code == _GRAD:
            self._critic_gradient(int(args[1]), int(args[2]), int(args[3]), shared)
        elif code == _STEP:
            divisor = float(args[1])
            grad_divisor = None if divisor == 0.0 else self.flat.divisor_tensor(divisor)
            self.adam.step_range(
                self.critic_part, grad_divisor, float(args[2]), float(args[3]), float(args[4]), float(args[5]), float(args[6])
            )
        elif code == _GATHER:
            if self._epoch is None:
                self._epoch = (th.empty_like(shared.obs), th.empty_like(shared.scalars))
            th.index_select(shared.obs, 0, shared.index, out=self._epoch[0])
            th.index_select(shared.scalars, 1, shared.index, out=self._epoch[1])
        elif code == _LOAD:
            clip_vf = float(args[2])
            self._cfg = PPOLossConfig(
                float(args[1]), None if math.isnan(clip_vf) else clip_vf, float(args[3]), float(args[4]), float(args[5])
            )
        else:
            raise ValueError(f"unknown command {code}")

    def _critic_gradient(self, start: int, end: int, row: int, shared: _Shared) -> None:
        assert self._epoch is not None and self._cfg is not None
        views = self._views.get((start, end))
        if views is None:
            obs, scalars = self._epoch
            views = self._views[(start, end)] = (obs[start:end], scalars[0, start:end], scalars[1, start:end])
        obs, old_values, returns = views
        n = end - start
        ws = self._ws.get(n) or self._workspace(n, obs.device)
        values = self.net.forward_part(obs, 1)
        mb = Minibatch(obs, {}, old_values, old_values, old_values, returns)
        self._value_loss(ws, mb, self._cfg, values)
        shared.results[row] = float(th.dot(ws["row"][VALUE_LOSS], ws["mean_weights"]))
        self._value_loss_gradient(ws, n, self._cfg)
        self.net.backward_part(ws["g_values"], 1)
