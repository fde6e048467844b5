"""
Prioritised experience replay (Schaul et al., 2016) and the combined-replay helper (Zhang & Sutton, 2017).

``PrioritizedReplayBuffer`` keeps SB3's ``ReplayBuffer`` storage unchanged (same arrays, same ``add``) and adds one
vectorised :class:`SumTree` with a leaf per ``(position, env)`` pair, flat id ``position * n_envs + env``.
Sampling is stratified (one uniform draw per segment of ``total / batch_size``) followed by one batched ``find``.
The gathering of the chosen transitions, including n-step returns, is SB3's own code: it is called on a per-env
view of the storage, because SB3's ``_get_samples`` chooses env indices at random and PER must choose them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups.common.replay.sampling import newest_indices
from sb3_speedups.dqn.replay.sum_tree import SumTree

__all__ = ["PrioritizedReplayBuffer", "PrioritizedReplayBufferSamples", "newest_indices"]


_STORAGE = ("observations", "next_observations", "actions", "rewards", "dones", "timeouts")


class PrioritizedReplayBufferSamples(NamedTuple):
    """``ReplayBufferSamples``' fields, in the same order, plus the importance-sampling weights and leaf ids."""

    observations: th.Tensor
    actions: th.Tensor
    next_observations: th.Tensor
    dones: th.Tensor
    rewards: th.Tensor
    discounts: th.Tensor | None
    weights: th.Tensor
    indices: np.ndarray


class PrioritizedReplayBuffer(ReplayBuffer):
    """
    Proportional prioritised replay buffer, optionally with n-step returns (SB3's ``NStepReplayBuffer`` maths).

    Leaf priorities are ``(|td_error| + epsilon) ** alpha``; new transitions get the largest priority seen so far
    (1.0 at the start). ``beta`` is public so that the algorithm can anneal it towards 1.

    :param buffer_size: Max number of transitions (over all envs), as in SB3
    :param observation_space: Observation space
    :param action_space: Action space
    :param device: PyTorch device
    :param n_envs: Number of parallel environments
    :param optimize_memory_usage: SB3's memory-efficient variant (next observation stored in the next slot)
    :param handle_timeout_termination: Treat time-limit truncation as non-terminal, as in SB3
    :param alpha: Priority exponent (0 gives uniform sampling)
    :param beta: Importance-sampling exponent (1 fully corrects the sampling bias)
    :param epsilon: Added to ``|td_error|`` so that no stored transition gets a zero priority
    :param n_steps: Number of steps of the n-step return (1: plain one-step transitions)
    :param gamma: Discount factor of the n-step return (only used when ``n_steps > 1``)
    """

    #: ``add`` copies what it is given (SB3's ``add``): the collection loop may skip its defensive copies
    add_keeps_no_references: ClassVar[bool] = True

    def __init__(
        self,
        buffer_size: int,
        observation_space: spaces.Space,
        action_space: spaces.Space,
        device: th.device | str = "auto",
        n_envs: int = 1,
        optimize_memory_usage: bool = False,
        handle_timeout_termination: bool = True,
        *,
        alpha: float = 0.6,
        beta: float = 0.4,
        epsilon: float = 1e-6,
        n_steps: int = 1,
        gamma: float = 0.99,
    ) -> None:
        if not alpha >= 0:
            raise ValueError(f"alpha must be >= 0, got alpha={alpha}")
        if not beta >= 0:
            raise ValueError(f"beta must be >= 0, got beta={beta}")
        if not epsilon > 0:
            raise ValueError(f"epsilon must be > 0, got epsilon={epsilon}")
        if int(n_steps) != n_steps or n_steps < 1:
            raise ValueError(f"n_steps must be a positive integer, got n_steps={n_steps}")
        if not 0 <= gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got gamma={gamma}")
        if n_steps > 1 and optimize_memory_usage:
            raise ValueError("n_steps > 1 is not supported with optimize_memory_usage=True (as in SB3's NStepReplayBuffer)")
        super().__init__(
            buffer_size,
            observation_space,
            action_space,
            device=device,
            n_envs=n_envs,
            optimize_memory_usage=optimize_memory_usage,
            handle_timeout_termination=handle_timeout_termination,
        )
        self.alpha = alpha
        self.beta = beta
        self.epsilon = epsilon
        self.n_steps = int(n_steps)
        self.gamma = gamma
        self.tree = SumTree(self.buffer_size * self.n_envs)
        self.max_priority = 1.0

    def add(
        self,
        obs: np.ndarray,
        next_obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        done: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        """Store one transition per env (SB3's ``add``) and give them the current max priority."""
        pos = self.pos
        super().add(obs, next_obs, action, reward, done, infos)
        leaves = pos * self.n_envs + np.arange(self.n_envs)
        self.tree.update(leaves, np.full(self.n_envs, self.max_priority))
        if self.optimize_memory_usage:
            # The next slot's observation now holds this step's next_obs, so its old transition is invalid.
            self.tree.update(self.pos * self.n_envs + np.arange(self.n_envs), np.zeros(self.n_envs))

    def n_stored(self) -> int:
        """Number of transitions that can be sampled (over all envs)."""
        positions = self.buffer_size if self.full else self.pos
        if self.optimize_memory_usage and self.full:
            positions -= 1
        return positions * self.n_envs

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:  # type: ignore[override]
        """
        Sample transitions with probability proportional to their priority.

        :param batch_size: Number of transitions
        :param env: VecNormalize wrapper to normalise observations and rewards, as in SB3
        :return: The samples, their importance-sampling weights ``[batch, 1]`` and their flat leaf ids ``[batch]``
        """
        total = self.tree.total
        if total <= 0 or self.n_stored() == 0:
            raise ValueError("cannot sample from an empty PrioritizedReplayBuffer")
        segment = total / batch_size
        values = (np.arange(batch_size) + np.random.uniform(size=batch_size)) * segment
        indices = self.tree.find(np.minimum(values, np.nextafter(total, 0.0)))
        priorities = self.tree.get(indices)
        invalid = priorities <= 0
        if invalid.any():
            # Floating-point rounding between leaf and node sums can land on an empty leaf: use the newest one.
            batch_newest, env_newest = newest_indices(self)
            indices[invalid] = batch_newest[0] * self.n_envs + env_newest[np.arange(int(invalid.sum())) % self.n_envs]
            priorities = self.tree.get(indices)
        weights = (self.n_stored() * priorities / total) ** (-self.beta)
        weights /= weights.max()
        samples = self.get_samples_at(indices // self.n_envs, indices % self.n_envs, env)
        return PrioritizedReplayBufferSamples(
            *samples[:5],
            samples.discounts,
            self.to_torch(weights.astype(np.float32).reshape(-1, 1)),
            indices,
        )

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray | th.Tensor) -> None:
        """
        Set the priorities of sampled transitions from their TD errors.

        :param indices: Flat leaf ids, as returned in ``sample().indices``
        :param priorities: ``|td_error|`` per index (the last value wins for repeated indices)
        """
        if isinstance(priorities, th.Tensor):
            priorities = priorities.detach().cpu().numpy()
        priorities = (np.abs(np.asarray(priorities, dtype=np.float64).ravel()) + self.epsilon) ** self.alpha
        self.tree.update(indices, priorities)
        self.max_priority = max(self.max_priority, float(priorities.max()))

    def get_samples_at(
        self, batch_inds: np.ndarray, env_inds: np.ndarray, env: VecNormalize | None = None
    ) -> ReplayBufferSamples:
        """
        Gather the transitions at ``(batch_inds, env_inds)`` with SB3's code (n-step returns when ``n_steps > 1``).

        :param batch_inds: Positions in the buffer
        :param env_inds: Env index of each position
        :param env: VecNormalize wrapper to normalise observations and rewards, as in SB3
        :return: The samples, in the order of the given indices
        """
        gather: Callable[[Any, np.ndarray, VecNormalize | None], ReplayBufferSamples] = (
            NStepReplayBuffer._get_samples if self.n_steps > 1 else ReplayBuffer._get_samples
        )
        if self.n_envs == 1:
            return gather(self, batch_inds, env)
        if self.n_steps == 1 and not self.optimize_memory_usage:
            # One-step samples read a single row, so one flat (position * n_envs + env) view serves all envs at once.
            return gather(self._flat_view(), batch_inds * self.n_envs + env_inds, env)
        order = np.argsort(env_inds, kind="stable")
        envs, starts = np.unique(env_inds[order], return_index=True)
        groups = np.split(order, starts[1:])
        parts = [gather(self._env_view(int(e)), batch_inds[group], env) for e, group in zip(envs, groups, strict=True)]
        inverse = th.as_tensor(np.argsort(order, kind="stable"), device=self.device)
        # zip(*parts) yields each field across groups; only ``discounts`` can be None, and then it is None in all of them.
        fields = [None if values[0] is None else th.cat(values)[inverse] for values in zip(*parts, strict=True)]  # type: ignore[arg-type]
        return ReplayBufferSamples(*fields)  # type: ignore[arg-type]

    def _shallow_view(self) -> PrioritizedReplayBuffer:
        view = object.__new__(type(self))
        view.__dict__.update(self.__dict__)
        view.n_envs = 1
        return view

    def _env_view(self, env_index: int) -> PrioritizedReplayBuffer:
        """A shallow copy whose storage arrays are views of one env's column, so SB3's env draw can only pick it."""
        view = self._shallow_view()
        for name in _STORAGE:
            if name in self.__dict__:
                setattr(view, name, self.__dict__[name][:, env_index : env_index + 1])
        return view

    def _flat_view(self) -> PrioritizedReplayBuffer:
        """A shallow copy whose storage arrays are ``[buffer_size * n_envs, 1, ...]`` views, indexed by leaf id."""
        view = self._shallow_view()
        view.buffer_size = self.buffer_size * self.n_envs
        for name in _STORAGE:
            if name in self.__dict__:
                array = self.__dict__[name]
                setattr(view, name, array.reshape(view.buffer_size, 1, *array.shape[2:]))
        return view
