"""
Proportional prioritised experience replay (Schaul et al. 2016, "Prioritized Experience Replay").

Each stored transition ``i`` (one per position and env) has priority ``p_i = (|delta_i| + epsilon) ** alpha`` and is
sampled with probability ``P(i) = p_i / sum_k p_k``; new transitions get the largest priority seen so far, so each
is replayed at least once soon. The loss is weighted by ``w_i = (N * P(i)) ** -beta / max_j w_j``. Sampling is
stratified (one uniform draw in each of ``batch_size`` equal segments of the total) and runs on the vectorised
:class:`~sb3_speedups.common.sum_tree.SumTree`: no Python loop over samples.

The storage is stock SB3's ``ReplayBuffer`` (same arrays, ``optimize_memory_usage`` and timeout handling); the only
extra memory is the tree. With ``n_steps > 1`` the samples are SB3's n-step returns (``NStepReplayBuffer``'s
computation, called on the prioritised indices).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups.common.replay_sampling import IndexDraw, gather, newest_indices
from sb3_speedups.common.sum_tree import SumTree


class PrioritizedReplayBufferSamples(NamedTuple):
    """``ReplayBufferSamples``' fields, in order, plus the importance-sampling weights and the sampled leaves."""

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
    Replay buffer with proportional prioritised sampling; see :class:`stable_baselines3.common.buffers.ReplayBuffer`
    for the arguments not listed here.

    :param alpha: how much prioritisation is used (0: uniform)
    :param beta: importance-sampling exponent (the algorithm anneals it to 1 through the public ``beta`` attribute)
    :param epsilon: added to ``|TD error|`` so that no transition gets probability 0
    :param n_steps: n-step returns (as ``NStepReplayBuffer``) when above 1; needs ``n_envs=1``
    :param gamma: discount of the n-step returns
    """

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
        if alpha < 0:
            raise ValueError(f"alpha={alpha} is invalid: use alpha >= 0")
        if not 0 <= beta <= 1:
            raise ValueError(f"beta={beta} is invalid: use a value in [0, 1]")
        if epsilon <= 0:
            raise ValueError(f"epsilon={epsilon} is invalid: use epsilon > 0")
        if n_steps < 1:
            raise ValueError(f"n_steps={n_steps} is invalid: use n_steps >= 1")
        if n_steps > 1 and (optimize_memory_usage or n_envs != 1):
            raise ValueError("prioritised n-step replay needs n_envs=1 and optimize_memory_usage=False")
        super().__init__(
            buffer_size, observation_space, action_space, device, n_envs, optimize_memory_usage, handle_timeout_termination
        )
        self.alpha, self.beta, self.epsilon = alpha, beta, epsilon
        self.n_steps, self.gamma = n_steps, gamma
        self.tree = SumTree(self.buffer_size * self.n_envs)
        self.max_priority = 1.0  # of the stored values p ** alpha

    def _row(self, pos: int) -> np.ndarray:
        return pos * self.n_envs + np.arange(self.n_envs)

    def add(self, obs: Any, next_obs: Any, action: Any, reward: Any, done: Any, infos: list[dict[str, Any]]) -> None:
        """Store one transition per env (as stock) at the largest priority so far."""
        pos = self.pos
        super().add(obs, next_obs, action, reward, done, infos)
        self.tree.update(self._row(pos), np.full(self.n_envs, self.max_priority))
        if self.optimize_memory_usage:
            # The slot to be written next shares its observation with this transition's next one: it is invalid.
            self.tree.update(self._row(self.pos), np.zeros(self.n_envs))

    def _n_valid(self) -> int:
        rows = self.buffer_size if self.full else self.pos
        if self.optimize_memory_usage and self.full:
            rows -= 1
        return rows * self.n_envs

    def sample(self, batch_size: int, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:  # type: ignore[override]
        """
        :param batch_size: number of transitions
        :param env: the ``VecNormalize`` wrapper, if any
        :return: the transitions, their importance-sampling weights ``[batch, 1]`` and leaf indices ``[batch]``
        """
        total = self.tree.total
        if total <= 0:
            raise ValueError("the replay buffer is empty")
        values = (np.arange(batch_size) + np.random.uniform(size=batch_size)) * (total / batch_size)
        leaves = self.tree.find(np.minimum(values, np.nextafter(total, 0)))
        priorities = self.tree.get(leaves)
        if not priorities.all():
            # Rounding in the prefix sums can land a draw on an empty leaf; give it the batch's likeliest one.
            leaves = np.where(priorities > 0, leaves, leaves[np.argmax(priorities)])
            priorities = self.tree.get(leaves)
        weights = (self._n_valid() * priorities / total) ** -self.beta
        weights /= weights.max()
        return self._samples(leaves, weights, env)

    def _samples(self, leaves: np.ndarray, weights: np.ndarray, env: VecNormalize | None) -> PrioritizedReplayBufferSamples:
        draw = IndexDraw(leaves // self.n_envs, leaves % self.n_envs)
        if self.n_steps > 1:
            # n_envs == 1: NStepReplayBuffer's own env draw can only pick env 0.
            data = NStepReplayBuffer._get_samples(self, draw.batch_inds, env)  # type: ignore[arg-type]
        else:
            data = gather(self, draw, env)
        w = self.to_torch(weights.astype(np.float32).reshape(-1, 1))
        return PrioritizedReplayBufferSamples(*data[:5], data.discounts, w, leaves)

    def newest_samples(self, env: VecNormalize | None = None) -> PrioritizedReplayBufferSamples:
        """:return: the last added transition of every env, with weight 1 (for combined experience replay)"""
        draw = newest_indices(self)
        leaves = draw.batch_inds * self.n_envs + draw.env_inds
        return self._samples(leaves, np.ones(len(leaves)), env)

    def update_priorities(self, indices: np.ndarray, priorities: np.ndarray | th.Tensor) -> None:
        """
        :param indices: leaf indices from :meth:`sample`
        :param priorities: ``|TD error|`` per index
        """
        if isinstance(priorities, th.Tensor):
            priorities = priorities.detach().cpu().numpy()
        values = (np.abs(np.asarray(priorities, dtype=np.float64)).reshape(-1) + self.epsilon) ** self.alpha
        self.tree.update(indices, values)
        self.max_priority = max(self.max_priority, float(values.max()))
