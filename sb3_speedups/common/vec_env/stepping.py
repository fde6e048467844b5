"""
Stepping a subset of the envs of a :class:`~sb3_speedups.common.vec_env.batched_subproc.BatchedSubprocVecEnv`
while the caller works on the others: the VecEnv side of double-buffered sampling.

A collector splits the envs with :meth:`SubsetSteppingMixin.halves`, then alternates::

    idx_a, idx_b = venv.halves()
    obs = venv.reset()
    venv.step_async_indices(policy(obs[idx_a]), idx_a)
    venv.step_async_indices(policy(obs[idx_b]), idx_b)
    while collecting:
        obs_a, rewards_a, dones_a, infos_a = venv.step_wait_indices(idx_a)   # half B keeps stepping meanwhile
        venv.step_async_indices(policy(obs_a), idx_a)
        obs_b, rewards_b, dones_b, infos_b = venv.step_wait_indices(idx_b)
        venv.step_async_indices(policy(obs_b), idx_b)

Each env sees exactly the actions it is given, so its own trajectory is the one ``DummyVecEnv`` would produce.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnvStepReturn

from sb3_speedups.errors import UserError, UserValueError


class SubsetSteppingMixin:
    """Adds ``halves``, ``step_async_indices`` and ``step_wait_indices`` to BatchedSubprocVecEnv."""

    # Provided by BatchedSubprocVecEnv
    num_envs: int
    n_local: int
    waiting: bool
    _pool: Any
    _active: np.ndarray

    def _init_subsets(self) -> None:
        self._pending_subsets: dict[tuple[int, ...], tuple[np.ndarray, Any, list[Any]]] = {}
        self._all_active = True

    def _check_idle(self, what: str) -> None:
        if self.waiting or self._pending_subsets:
            raise UserError(f"{what} called while a step is pending; call step_wait (or step_wait_indices) first")
        # A step whose wait was interrupted (Ctrl+C) still has its answer coming: take it before the next command.
        stale = [worker for worker in self._pool.workers if worker.pending]
        if stale:
            self._pool.finish_quietly(stale)

    def halves(self) -> tuple[np.ndarray, np.ndarray]:
        """
        Two disjoint sets of env indices, each stepped by its own processes, covering all envs.

        :return: ``(indices_a, indices_b)``, sorted; the envs of the main process (if any) are in the first
        """
        workers = self._pool.workers
        if len(workers) >= 2:
            middle = workers[len(workers) // 2].first
        elif len(workers) == 1 and self.n_local > 0:
            middle = self.n_local
        else:
            raise UserError("halves() needs two groups of envs: create the VecEnv with n_workers >= 2 and n_local=0")
        return np.arange(middle), np.arange(middle, self.num_envs)

    def _subset(self, indices: Any) -> tuple[tuple[int, ...], np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size == 0 or np.any(np.diff(idx) <= 0) or idx[0] < 0 or idx[-1] >= self.num_envs:
            raise UserValueError(f"indices must be sorted, unique env indices in [0, {self.num_envs}), got {indices!r}")
        return tuple(idx.tolist()), idx

    def step_async_indices(self, actions: Any, indices: Any) -> None:
        """
        Start stepping only the envs ``indices`` (their workers run while the caller goes on).

        :param actions: one action per env of ``indices``, in the same order
        :param indices: sorted env indices, none of them part of a step still pending
        """
        self._check_usable()  # type: ignore[attr-defined]
        key, idx = self._subset(indices)
        if self.waiting:
            raise UserError("step_async_indices called while step_async is pending; call step_wait first")
        if len(actions) != len(idx):
            raise UserValueError(f"got {len(actions)} actions for {len(idx)} envs")
        busy = {i for pending_idx, _, _ in self._pending_subsets.values() for i in pending_idx.tolist()}
        workers = [w for w in self._pool.workers if np.any((idx >= w.first) & (idx < w.stop))]
        if busy.intersection(key) or any(w.pending for w in workers):
            raise UserError("these envs share a worker with a pending step; use halves() or wait for that step first")
        remote = idx >= self.n_local
        rows = idx[remote]
        if workers:
            for worker in workers:
                self._active[worker.first : worker.stop] = False
            self._active[rows] = True
            self._all_active = False
            remote_actions: Any
            if isinstance(actions, np.ndarray):
                remote_actions = actions[remote]
            else:
                remote_actions = [a for a, is_remote in zip(actions, remote, strict=True) if is_remote]
            self._send_step(remote_actions, workers, rows=rows)  # type: ignore[attr-defined]
        self._pending_subsets[key] = (idx, actions, workers)

    def step_wait_indices(self, indices: Any) -> VecEnvStepReturn:
        """
        Finish the step started by :meth:`step_async_indices` with the same ``indices``.

        :param indices: the indices given to ``step_async_indices``
        :return: observations, rewards, dones and infos of those envs only, in the order of ``indices``
        """
        key, idx = self._subset(indices)
        if key not in self._pending_subsets:
            raise UserError("step_wait_indices called for indices with no pending step_async_indices")
        idx, actions, workers = self._pending_subsets.pop(key)
        local_ids = idx[idx < self.n_local]
        local_records = []
        if local_ids.size:
            flags = np.zeros(self.num_envs, dtype=bool)
            flags[local_ids] = True
            by_index = {int(i): actions[pos] for pos, i in enumerate(idx) if i < self.n_local}
            try:
                local_records = self._local.step(by_index, flags)  # type: ignore[attr-defined]
            except BaseException:
                self._pool.finish_quietly(workers)
                raise
        remote_records = self._pool.collect(workers)
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": False} for _ in range(len(idx))]
        position = {int(i): pos for pos, i in enumerate(idx)}
        self._apply_records(infos, local_records, local=True, position=position)  # type: ignore[attr-defined]
        self._apply_records(infos, remote_records, local=False, position=position)  # type: ignore[attr-defined]
        return self._obs(idx), self._rewards[idx], self._dones[idx], infos  # type: ignore[attr-defined]
