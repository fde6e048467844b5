"""
:class:`BatchedSubprocVecEnv`: several envs per worker process, all results in one shared-memory block.

Per step the hot path pickles nothing but the infos that carry more than ``TimeLimit.truncated=False`` (episode
ends, envs with rich infos). The main process steps some envs itself while the workers step the others: on two
cores one worker plus the main process beats two workers, and for very cheap envs (CartPole) stepping them all
in-process beats any inter-process round trip. How many stay in-process is measured at start-up.
"""

from __future__ import annotations

import multiprocessing as mp
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

import cloudpickle
import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn
from stable_baselines3.common.vec_env.util import dict_to_obs

from sb3_speedups.common.vec_env import startup
from sb3_speedups.common.vec_env.env_group import (
    ENV_COMMANDS,
    EnvGroup,
    InfoRecord,
    detach_info,
    make_envs,
    obs_keys,
    obs_specs,
    resolve_indices,
)
from sb3_speedups.common.vec_env.pool import WorkerDiedError, WorkerHandle, WorkerPool, unlink_semaphore_names
from sb3_speedups.common.vec_env.shared_memory import ArraySpec, SharedArrays
from sb3_speedups.common.vec_env.stepping import SubsetSteppingMixin
from sb3_speedups.common.vec_env.worker import ACTION_DTYPES, ACTION_ITEM_BYTES, ACTIONS_ON_PIPE, CONTROL_SLOTS
from sb3_speedups.errors import UserError, UserValueError

# Each side polls this long before blocking on a semaphore. A blocked side wakes up tens of microseconds late; the
# gap between a worker's reply and its next command is the main process's own envs plus the policy, a few hundred
# microseconds, so polling through it keeps both sides awake. The poll yields the core, and is bounded.
DEFAULT_SPIN_US = 300.0
PAYLOAD_BYTES = 1 << 20  # per worker; memory is only committed where written, bigger payloads use the pipe
_CODES = {dtype: code for code, dtype in enumerate(ACTION_DTYPES)}


class BatchedSubprocVecEnv(SubsetSteppingMixin, VecEnv):
    """
    A drop-in for SB3's ``SubprocVecEnv`` (same ``env_fns``, same results as ``DummyVecEnv``) that runs several
    envs per worker and moves observations, rewards, dones and actions through shared memory.

    :param env_fns: functions that each create one env
    :param n_workers: worker processes; default: one per usable CPU core beyond the main process's own (at least
        one), never more than the envs given to workers
    :param start_method: ``fork``, ``forkserver`` or ``spawn``; default ``forkserver`` where available (as SB3)
    :param n_local: envs stepped by the main process itself; ``"auto"`` times one step of a throw-away env at
        start-up, rehearses every split with synthetic work of that cost and keeps the fastest (with
        ``n_workers`` left at ``None`` this may keep all envs in-process, when the env is too cheap or the
        machine too busy for parallel stepping to pay off); the choice is in ``n_local``, the timings in
        ``split_times``
    :param spin_us: how long each side polls (yielding the core) before it blocks on a semaphore, in microseconds
    """

    def __init__(
        self,
        env_fns: list[Callable[[], gym.Env]],
        n_workers: int | None = None,
        start_method: str | None = None,
        *,
        n_local: int | str = "auto",
        spin_us: float = DEFAULT_SPIN_US,
    ) -> None:
        n_envs = len(env_fns)
        auto = _check_args(n_envs, n_workers, start_method, n_local, spin_us)
        self.closed = False
        self.waiting = False
        # Start-up measurements (with n_local="auto"): seconds per env step, and per VecEnv step for each split
        self.step_cost: float | None = None
        self.split_times: dict[int, float] = {}
        self._pool = WorkerPool(mp.get_context(start_method or startup.default_start_method()), spin_us * 1e-6)
        self._shared: SharedArrays | None = None
        self._local: EnvGroup | None = None
        try:
            planned = _planned_workers(n_envs, n_workers, n_local, auto)
            if auto:
                step_cost, info_cost = startup.measure_step_cost(env_fns[0])
                self.step_cost = step_cost
                if n_workers is None and not startup.parallel_may_pay(n_envs, planned, step_cost, info_cost):
                    planned = 0
            self._pool.start(planned)
            if auto:
                n_local = n_envs
                if planned:
                    keep = n_workers is not None
                    self.split_times = startup.choose_n_local(self._pool, n_envs, step_cost, info_cost, keep_workers=keep)
                    n_local = startup.pick_split(self.split_times)
            self.n_local = int(n_local)
            if self.n_local == n_envs and self._pool.workers:
                self._pool.close()
                self._pool.teardown()
            observation_space, action_space = self._make_envs(env_fns)
            self._attach(n_envs, observation_space, action_space)
        except BaseException:
            self._pool.abandon()
            self._teardown()
            raise
        self._init_subsets()
        super().__init__(n_envs, observation_space, action_space)
        # As DummyVecEnv: the envs' own metadata (render_fps for video recorders, ...)
        self.metadata = self.get_attr("metadata", indices=[0])[0]

    # --- start-up -------------------------------------------------------------------------------------------
    def _make_envs(self, env_fns: list[Callable[[], gym.Env]]) -> tuple[gym.spaces.Space, gym.spaces.Space]:
        pool, n_local = self._pool, self.n_local
        bounds = np.linspace(n_local, len(env_fns), len(pool.workers) + 1).round().astype(int)
        for worker, first, stop in zip(pool.workers, bounds[:-1], bounds[1:], strict=True):
            worker.first, worker.stop = int(first), int(stop)
            pool.request(worker, "make_envs", (worker.first, cloudpickle.dumps(env_fns[first:stop])))
        try:
            self._local_envs = make_envs(env_fns[:n_local], 0, "main process")
        except Exception:
            pool.replies_quietly(pool.workers)
            raise
        if len({id(env.unwrapped) for env in self._local_envs}) != len(self._local_envs):
            for env in self._local_envs:
                env.close()
            pool.replies_quietly(pool.workers)
            raise UserValueError("env_fns returned the same env object twice; each function must create a new env (gym.make)")
        pool.replies(pool.workers)
        # Every worker has answered, so it has opened its semaphores: their names are no longer needed.
        unlink_semaphore_names([sem for worker in pool.workers for sem in (worker.go, worker.done)])
        if self._local_envs:
            return self._local_envs[0].observation_space, self._local_envs[0].action_space
        pool.request(pool.workers[0], "get_spaces", None)
        return pool.reply(pool.workers[0])

    def _attach(self, n_envs: int, observation_space: gym.spaces.Space, action_space: gym.spaces.Space) -> None:
        action_shape = tuple(action_space.shape) if action_space.shape is not None else ()
        n_action_items = int(np.prod(action_shape, dtype=np.int64))
        workers = self._pool.workers
        specs = [
            ArraySpec("control", (max(len(workers), 1), CONTROL_SLOTS), "<i8"),
            ArraySpec("active", (n_envs,), "|b1"),
            ArraySpec("rewards", (n_envs,), "<f4"),
            ArraySpec("dones", (n_envs,), "|b1"),
            ArraySpec("actions", (n_envs * n_action_items * ACTION_ITEM_BYTES,), "|u1"),
            *obs_specs(observation_space, n_envs),
            ArraySpec("payload", (max(len(workers), 1), PAYLOAD_BYTES if workers else 0), "|u1"),
        ]
        self._shared = shared = SharedArrays(specs)
        for worker in workers:
            self._pool.request(worker, "attach", (specs, observation_space, action_shape))
            reduction.send_handle(worker.conn, shared.fd, worker.process.pid)
        self._pool.replies(workers)
        for worker in workers:
            worker.attached = True
            worker.control = shared["control"][worker.index]
            worker.payload = shared["payload"][worker.index]
        self._obs_arrays = [(key, shared[name]) for key, name in obs_keys(observation_space)]
        self._rewards, self._dones, self._active = shared["rewards"], shared["dones"], shared["active"]
        self._active[:] = True
        self._item_shape = action_shape if action_space.shape is not None else None
        self._action_views = {
            code: shared.view("actions", dtype, (n_envs, *action_shape)) for code, dtype in enumerate(ACTION_DTYPES)
        }
        self._local = EnvGroup(self._local_envs, 0, self._obs_arrays, self._rewards, self._dones, "main process")

    # --- shared helpers of the step paths -------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._pool.broken is not None:
            raise WorkerDiedError(self._pool.broken)
        if self.closed:
            raise UserError("this BatchedSubprocVecEnv is closed; create a new one")

    def _send_step(self, actions: Any, workers: Sequence[WorkerHandle], rows: np.ndarray | None = None) -> None:
        """Hand ``actions`` (one per env of ``rows``; default: indexed by env, all envs) to ``workers``."""
        code = ACTIONS_ON_PIPE
        if type(actions) is np.ndarray and self._item_shape is not None and actions.shape[1:] == self._item_shape:
            code = _CODES.get(actions.dtype, ACTIONS_ON_PIPE)
        by_index = None
        if rows is None:
            if code != ACTIONS_ON_PIPE:
                self._action_views[code][self.n_local :] = actions[self.n_local :]
            else:
                by_index = {i: actions[i] for i in range(self.n_local, self.num_envs)}
        elif code != ACTIONS_ON_PIPE:
            self._action_views[code][rows] = actions
        else:
            by_index = dict(zip(rows.tolist(), actions, strict=True))
        self._pool.start_step(workers, code, by_index)

    def _apply_records(
        self, infos: list[dict[str, Any]], records: list[InfoRecord], local: bool, position: dict[int, int] | None = None
    ) -> None:
        for index, info, reset_info in records:
            infos[index if position is None else position[index]] = detach_info(info) if local else info
            if reset_info is not None:
                self.reset_infos[index] = reset_info

    def _obs(self, rows: np.ndarray | None = None) -> VecEnvObs:
        # An OrderedDict, as DummyVecEnv returns for Dict spaces
        if rows is None:
            parts = OrderedDict((key, array.copy()) for key, array in self._obs_arrays)
        else:
            parts = OrderedDict((key, array[rows]) for key, array in self._obs_arrays)
        return dict_to_obs(self.observation_space, parts)

    # --- VecEnv API -----------------------------------------------------------------------------------------
    def step_async(self, actions: np.ndarray) -> None:
        self._check_usable()
        self._check_idle("step_async")
        self._actions = actions
        if self._pool.workers:
            if not self._all_active:
                self._active[:] = True
                self._all_active = True
            self._send_step(actions, self._pool.workers)
        self.waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        assert self._local is not None
        self.waiting = False
        try:
            local_records = self._local.step(self._actions, None)
        except BaseException:
            self._pool.finish_quietly(self._pool.workers)
            raise
        remote_records = self._pool.collect(self._pool.workers)
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": False} for _ in range(self.num_envs)]
        self._apply_records(infos, local_records, local=True)
        self._apply_records(infos, remote_records, local=False)
        return self._obs(), self._rewards.copy(), self._dones.copy(), infos

    def reset(self) -> VecEnvObs:
        self._check_usable()
        self._drain()
        assert self._local is not None
        pool, n_local = self._pool, self.n_local
        for worker in pool.workers:
            span = slice(worker.first, worker.stop)
            pool.request(worker, "reset", (self._seeds[span], self._options[span]))
        try:
            self.reset_infos[:n_local] = self._local.reset(self._seeds[:n_local], self._options[:n_local])
        except BaseException:
            pool.replies_quietly(pool.workers)
            raise
        for worker, reset_infos in zip(pool.workers, pool.replies(pool.workers), strict=True):
            self.reset_infos[worker.first : worker.stop] = reset_infos
        self._reset_seeds()
        self._reset_options()
        return self._obs()

    def _drain(self) -> None:
        """Finish the steps still running in workers (``reset`` cancels pending work, as SB3 documents)."""
        self.waiting = False
        self._pending_subsets.clear()
        self._pool.finish_quietly([worker for worker in self._pool.workers if worker.pending])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._pool.broken is None:
                self._drain()
                self._pool.close()
            else:
                self._pool.abandon()
        except Exception:  # a worker that cannot close cleanly is killed by the teardown
            pass
        finally:
            try:
                if self._local is not None:
                    self._local.close()
            finally:
                self._teardown()

    def _teardown(self) -> None:
        self._pool.teardown()
        if self._shared is not None:
            self._obs_arrays, self._action_views = [], {}
            self._shared.close()
            self._shared = None

    def _gather(self, name: str, args: tuple[Any, ...], indices: VecEnvIndices) -> list[Any]:
        """Run an :data:`ENV_COMMANDS` command on the envs ``indices`` wherever they live; results in their order."""
        self._check_usable()
        self._check_idle(name)
        assert self._local is not None
        order = resolve_indices(self._get_indices(indices), self.num_envs)
        # Positions in ``order`` served by the main process and by each worker (an index may repeat)
        local = [p for p, i in enumerate(order) if i < self.n_local]
        remote = {w: pos for w in self._pool.workers if (pos := [p for p, i in enumerate(order) if w.first <= i < w.stop])}
        for worker, pos in remote.items():
            self._pool.request(worker, name, (args, [order[p] for p in pos]))
        results: list[Any] = [None] * len(order)
        try:
            local_values = ENV_COMMANDS[name](self._local.targets([order[p] for p in local]), args)
        except BaseException:
            self._pool.replies_quietly(list(remote))
            raise
        replies = self._pool.replies(list(remote))
        for pos, values in [(local, local_values), *zip(remote.values(), replies, strict=True)]:
            for p, value in zip(pos, values, strict=True):
                results[p] = value
        return results

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self._gather("get_attr", (attr_name,), indices)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        self._gather("set_attr", (attr_name, value), indices)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        return self._gather("env_method", (method_name, method_args, method_kwargs), indices)

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return self._gather("is_wrapped", (wrapper_class,), indices)

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images."
            )
            return [None for _ in range(self.num_envs)]
        return self._gather("get_images", (), None)

    def worker_pids(self) -> list[int]:
        """:return: process ids of the running workers (the main process's own envs are not listed)"""
        return [int(worker.process.pid) for worker in self._pool.workers]


def _planned_workers(n_envs: int, n_workers: int | None, n_local: int | str, auto: bool) -> int:
    cores = startup.usable_cores()
    if auto:
        return min(n_workers if n_workers is not None else max(1, cores - 1), n_envs)
    remote = n_envs - int(n_local)
    if remote == 0:
        return 0
    return min(n_workers or (cores if n_local == 0 else max(1, cores - 1)), remote)


def _check_args(n_envs: int, n_workers: int | None, start_method: str | None, n_local: int | str, spin_us: float) -> bool:
    if n_envs == 0:
        raise UserValueError("BatchedSubprocVecEnv needs at least one env function")
    if start_method is not None and start_method not in mp.get_all_start_methods():
        # Worded as multiprocessing's own error, which stock SubprocVecEnv lets through (and SB3's tests match)
        methods = mp.get_all_start_methods()
        raise UserValueError(f"cannot find context for {start_method!r}: pass start_method as one of {methods} or None")
    if n_workers is not None and not (isinstance(n_workers, int) and n_workers >= 1):
        raise UserValueError(f"n_workers must be a positive integer or None, got {n_workers!r}")
    if spin_us < 0:
        raise UserValueError(f"spin_us must be >= 0, got {spin_us!r}")
    if n_local == "auto":
        return True
    if not isinstance(n_local, int) or not 0 <= n_local <= n_envs:
        raise UserValueError(f"n_local must be 'auto' or an integer in [0, {n_envs}], got {n_local!r}")
    if n_local == n_envs and n_workers is not None:
        raise UserValueError(f"n_local={n_local} keeps every env in the main process; leave n_workers=None or lower n_local")
    return False
