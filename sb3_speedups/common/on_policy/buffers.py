"""
Rollout buffers whose storage is allocated once, as torch tensors with SB3's numpy attributes as views of them,
and GAE as a pure function vectorised over envs.

The buffers keep SB3's names and shapes (``observations``, ``rewards``, ... ``[n_steps, n_envs, ...]``) so code
that reads a stock ``RolloutBuffer`` keeps working, and they remember what GAE needs to be recomputed later with a
newer value function: the observation after the last step and the terminal observations of truncated episodes.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm
from stable_baselines3.common.type_aliases import DictRolloutBufferSamples, RolloutBufferSamples

from sb3_speedups.common.on_policy.timeouts import Timeouts
from sb3_speedups.common.torch_utils import trains_channels_last


@dataclass
class TimeoutRecord:
    """The timeouts of one step of the rollout, kept to recompute their bootstrap with a newer value function."""

    pos: int
    timeouts: Timeouts


def compute_gae(
    rewards: np.ndarray,
    values: np.ndarray,
    episode_starts: np.ndarray,
    last_values: np.ndarray,
    dones: np.ndarray,
    gamma: float,
    gae_lambda: float,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """
    Generalised advantage estimation (Schulman et al. 2016) over ``[n_steps, n_envs]`` arrays, as SB3 computes it.

    Truncated episodes are expected to have ``gamma * V(terminal observation)`` already added to their last reward
    (SB3's timeout bootstrap); the episode boundary itself then cuts the recursion like a termination.

    :param rewards: rewards ``r_t``
    :param values: value estimates ``V(s_t)``
    :param episode_starts: whether ``s_t`` starts an episode (the previous step ended one)
    :param last_values: ``V`` of the observation after the last step ``[n_envs]``
    :param dones: whether the last step ended an episode ``[n_envs]``
    :param gamma: discount factor
    :param gae_lambda: GAE's bias-variance trade-off (1: Monte-Carlo, 0: one-step TD)
    :param out: array to write the advantages into (may not alias the inputs)
    :return: the advantages ``[n_steps, n_envs]`` (float32); the returns are ``advantages + values``
    """
    rewards = np.asarray(rewards, dtype=np.float32)
    values = np.asarray(values, dtype=np.float32)
    next_non_terminal = np.empty_like(values)
    next_non_terminal[:-1] = 1.0 - np.asarray(episode_starts[1:], dtype=np.float32)
    next_non_terminal[-1] = 1.0 - np.asarray(dones, dtype=np.float32)
    next_values = np.empty_like(values)
    next_values[:-1] = values[1:]
    next_values[-1] = np.asarray(last_values, dtype=np.float32).reshape(-1)
    # The TD errors of all steps at once; only the discounted sum over time stays sequential.
    deltas = rewards + gamma * next_values * next_non_terminal - values
    decay = gamma * gae_lambda * next_non_terminal
    advantages = np.empty_like(values) if out is None else out
    last = np.zeros(values.shape[1:], dtype=np.float32)
    for step in range(values.shape[0] - 1, -1, -1):
        last = deltas[step] + decay[step] * last
        advantages[step] = last
    return advantages


def env_major_to_time_major(indices: np.ndarray, n_steps: int, n_envs: int) -> np.ndarray:
    """
    SB3 flattens ``[n_steps, n_envs]`` env by env (``swap_and_flatten``); the buffers here stay time-major.

    :param indices: indices into SB3's env-major flattening
    :return: the same samples' indices into the time-major flattening
    """
    return (indices % n_steps) * n_envs + indices // n_steps


def _zeros(shape: tuple[int, ...], dtype: Any) -> tuple[th.Tensor, np.ndarray]:
    tensor = th.from_numpy(np.zeros(shape, dtype=dtype))
    return tensor, tensor.numpy()


class FastRolloutBase:
    """Shared part of the two buffers: storage allocated once, ``add`` without copies of copies, GAE bookkeeping."""

    buffer_size: int
    n_envs: int
    action_dim: int
    pos: int
    full: bool
    gamma: float
    gae_lambda: float
    observations: Any
    actions: np.ndarray
    rewards: np.ndarray
    returns: np.ndarray
    episode_starts: np.ndarray
    values: np.ndarray
    log_probs: np.ndarray
    advantages: np.ndarray
    tensors: dict[str, Any]

    def _allocate_common(self) -> None:
        shape = (self.buffer_size, self.n_envs)
        self.tensors = {}
        self.tensors["actions"], self.actions = _zeros((*shape, self.action_dim), np.float32)
        for name in ("rewards", "returns", "episode_starts", "values", "log_probs", "advantages"):
            self.tensors[name], array = _zeros(shape, np.float32)
            setattr(self, name, array)
        self.timeouts: list[TimeoutRecord] = []
        self.last_observations: Any = None
        self.last_dones = np.zeros(self.n_envs, dtype=np.float32)

    def reset(self) -> None:
        if not hasattr(self, "tensors"):
            self._allocate()  # type: ignore[attr-defined]
        self.timeouts = []
        self.pos, self.full = 0, False
        self.generator_ready = False

    def _add_common(
        self, action: np.ndarray, reward: np.ndarray, episode_start: np.ndarray, value: th.Tensor, log_prob: th.Tensor
    ) -> None:
        pos = self.pos
        self.actions[pos] = np.asarray(action).reshape((self.n_envs, self.action_dim))
        self.rewards[pos] = reward
        self.episode_starts[pos] = episode_start
        if value.is_cpu and log_prob.is_cpu:
            # numpy assignment: about a third of the cost of selecting a row tensor and copying into it (the actors'
            # results need no detach)
            self.values[pos] = (value.detach() if value.requires_grad else value).numpy().reshape(-1)
            self.log_probs[pos] = (log_prob.detach() if log_prob.requires_grad else log_prob).numpy().reshape(-1)
        else:
            self.tensors["values"][pos].copy_(value.reshape(-1))
            self.tensors["log_probs"][pos].copy_(log_prob.reshape(-1))
        self.pos += 1
        if self.pos == self.buffer_size:
            self.full = True

    def add(self, *args: Any, **kwargs: Any) -> None:
        """Store one step of every env (SB3's ``RolloutBuffer.add`` signature)."""
        raise NotImplementedError

    def store_images_channels_last(self) -> None:
        """Lay image observations out channels-last (where the buffer can; nothing here)."""

    def add_timeouts(self, timeouts: Timeouts) -> None:
        """
        Remember truncated episodes of the current step (call before :meth:`add`), to recompute their bootstrap.

        :param timeouts: the step's bootstrapped timeouts (their bootstrap already added to the rewards)
        """
        self.timeouts.append(TimeoutRecord(self.pos, timeouts))

    def set_last_observations(self, obs: Any) -> None:
        """Keep the observation after the last step (a copy), for :meth:`recompute_returns_and_advantage`."""
        self.last_observations = {k: np.copy(v) for k, v in obs.items()} if isinstance(obs, dict) else np.copy(obs)

    def compute_returns_and_advantage(self, last_values: th.Tensor, dones: np.ndarray) -> None:
        """GAE with the values stored during collection, as stock SB3 (``returns = advantages + values``)."""
        self.last_dones = np.asarray(dones, dtype=np.float32).copy()
        last = last_values.detach().cpu().numpy().reshape(-1)
        compute_gae(
            self.rewards,
            self.values,
            self.episode_starts,
            last,
            self.last_dones,
            self.gamma,
            self.gae_lambda,
            out=self.advantages,
        )
        np.add(self.advantages, self.values, out=self.returns)

    def recompute_returns_and_advantage(
        self, values: np.ndarray, last_values: np.ndarray, timeout_values: list[np.ndarray]
    ) -> None:
        """
        GAE again with a newer value function; the stored ``values`` (the rollout's, used for value clipping) stay.

        :param values: new ``V(s_t)`` ``[n_steps, n_envs]``
        :param last_values: new ``V`` of :attr:`last_observations`
        :param timeout_values: new ``V`` of each :meth:`add_timeouts` record's terminal observations
        """
        rewards = self.rewards.copy()
        for record, new in zip(self.timeouts, timeout_values, strict=True):
            step = record.timeouts
            rewards[record.pos, step.envs] += self.gamma * np.asarray(new, dtype=np.float32) - step.bootstrap
        compute_gae(
            rewards,
            values,
            self.episode_starts,
            last_values,
            self.last_dones,
            self.gamma,
            self.gae_lambda,
            out=self.advantages,
        )
        np.add(self.advantages, values, out=self.returns)

    def flat(self, name: str) -> th.Tensor:
        """:return: the tensor ``name`` flattened time-major to ``[n_steps * n_envs, ...]`` (a view)"""
        tensor = self.tensors[name]
        return tensor.view(self.buffer_size * self.n_envs, *tensor.shape[2:])

    def flat_observations(self) -> th.Tensor | dict[str, th.Tensor]:
        """:return: the observations flattened time-major (views)"""
        raise NotImplementedError

    def _sample_indices(self, batch_size: int | None) -> Generator[np.ndarray, None, None]:
        assert self.full, "the rollout buffer is not full"
        n = self.buffer_size * self.n_envs
        indices = np.random.permutation(n)
        batch_size = n if batch_size is None else batch_size
        for start in range(0, n, batch_size):
            yield env_major_to_time_major(indices[start : start + batch_size], self.buffer_size, self.n_envs)

    def _common_samples(self, rows: np.ndarray, device: th.device) -> list[th.Tensor]:
        index = th.from_numpy(rows)
        return [self.flat(name)[index].to(device) for name in ("actions", "values", "log_probs", "advantages", "returns")]


class FastRolloutBuffer(FastRolloutBase, RolloutBuffer):
    """
    Drop-in ``RolloutBuffer`` (same constructor, attributes and ``get``) with storage allocated once and GAE
    recomputable with a newer value function. ``get`` does not rearrange the storage.
    """

    def _allocate(self) -> None:
        self.tensors_obs, self.observations = _zeros(
            (self.buffer_size, self.n_envs, *self.obs_shape), self.observation_space.dtype
        )
        self._allocate_common()

    def add(  # type: ignore[override]
        self,
        obs: np.ndarray,
        action: np.ndarray,
        reward: np.ndarray,
        episode_start: np.ndarray,
        value: th.Tensor,
        log_prob: th.Tensor,
    ) -> None:
        if isinstance(self.observation_space, spaces.Discrete):
            obs = np.asarray(obs).reshape((self.n_envs, *self.obs_shape))
        if self.observations.flags.c_contiguous or not (isinstance(obs, np.ndarray) and obs.flags.c_contiguous):
            self.observations[self.pos] = obs
        else:  # plain rows into channels-last storage: torch's reordering copy is ~3x faster than numpy's
            self.tensors_obs[self.pos].copy_(th.from_numpy(obs))
        self._add_common(action, reward, episode_start, value, log_prob)

    def store_images_channels_last(self) -> None:
        """
        Keep ``[C, H, W]`` observations channels-last: the same shape and values, laid out ``[H, W, C]`` in memory.
        ``VecTransposeImage`` hands over frames laid out so (stored here without a transposing copy), and a
        convolution trained on the CPU reads them so (its minibatches need no conversion).
        """
        if len(self.obs_shape) != 3:
            return
        c, h, w = self.obs_shape
        storage = np.zeros((self.buffer_size, self.n_envs, h, w, c), dtype=self.observation_space.dtype)
        self.observations = storage.transpose(0, 1, 4, 2, 3)
        self.tensors_obs = th.from_numpy(self.observations)

    def flat_observations(self) -> th.Tensor:
        return self.tensors_obs.view(self.buffer_size * self.n_envs, *self.obs_shape)

    def get(self, batch_size: int | None = None) -> Generator[RolloutBufferSamples, None, None]:  # type: ignore[override]
        for rows in self._sample_indices(batch_size):
            obs = self.flat_observations()[th.from_numpy(rows)].to(self.device)
            yield RolloutBufferSamples(obs, *self._common_samples(rows, self.device))


class FastDictRolloutBuffer(FastRolloutBase, DictRolloutBuffer):
    """The ``Dict``-observation twin of :class:`FastRolloutBuffer` (a drop-in ``DictRolloutBuffer``)."""

    def _allocate(self) -> None:
        self.tensors_obs, self.observations = {}, {}
        for key, shape in self.obs_shape.items():
            dtype = self.observation_space.spaces[key].dtype  # type: ignore[attr-defined]
            self.tensors_obs[key], self.observations[key] = _zeros((self.buffer_size, self.n_envs, *shape), dtype)
        self._allocate_common()

    def add(  # type: ignore[override]
        self,
        obs: dict[str, np.ndarray],
        action: np.ndarray,
        reward: np.ndarray,
        episode_start: np.ndarray,
        value: th.Tensor,
        log_prob: th.Tensor,
    ) -> None:
        for key, array in self.observations.items():
            value_obs = np.asarray(obs[key])
            if isinstance(self.observation_space.spaces[key], spaces.Discrete):  # type: ignore[attr-defined]
                value_obs = value_obs.reshape((self.n_envs, *self.obs_shape[key]))
            array[self.pos] = value_obs
        self._add_common(action, reward, episode_start, value, log_prob)

    def flat_observations(self) -> dict[str, th.Tensor]:
        n = self.buffer_size * self.n_envs
        return {key: t.view(n, *self.obs_shape[key]) for key, t in self.tensors_obs.items()}

    def get(self, batch_size: int | None = None) -> Generator[DictRolloutBufferSamples, None, None]:  # type: ignore[override]
        for rows in self._sample_indices(batch_size):
            index = th.from_numpy(rows)
            obs = {key: t[index].to(self.device) for key, t in self.flat_observations().items()}
            yield DictRolloutBufferSamples(obs, *self._common_samples(rows, self.device))


def install_fast_rollout_buffer(
    model: OnPolicyAlgorithm, fast_classes: dict[type[RolloutBuffer], type[RolloutBuffer]] | None = None
) -> None:
    """
    Replace the rollout buffer stock ``_setup_model`` made by ours (custom buffer classes are used as given). A policy
    with convolutions trained on the CPU gets its image observations stored channels-last.

    :param model: the model, right after stock ``_setup_model``
    :param fast_classes: our buffer class for each stock one (default: PPO's and A2C's)
    """
    classes: dict[type[RolloutBuffer], type[RolloutBuffer]] = fast_classes or {
        RolloutBuffer: FastRolloutBuffer,
        DictRolloutBuffer: FastDictRolloutBuffer,
    }
    fast_class = classes.get(model.rollout_buffer_class)  # type: ignore[arg-type]
    if fast_class is not None:
        # Keep the stock class name in rollout_buffer_class, so saved files load where this package is absent.
        buffer = model.rollout_buffer = fast_class(
            model.n_steps,
            model.observation_space,  # type: ignore[arg-type]
            model.action_space,
            device=model.device,
            gamma=model.gamma,
            gae_lambda=model.gae_lambda,
            n_envs=model.n_envs,
            **model.rollout_buffer_kwargs,
        )
        if isinstance(buffer, FastRolloutBase) and trains_channels_last(model.policy, model.device):
            buffer.store_images_channels_last()
