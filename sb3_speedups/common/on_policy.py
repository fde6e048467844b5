"""
Collecting one on-policy rollout with an actor (:mod:`sb3_speedups.common.inference`): one batched policy call per
vectorised step, SB3's semantics kept (``callback.on_step`` once per step with ``update_locals``, episode info
buffer, ``_last_obs``/``_last_episode_starts``, timeout bootstrap with the terminal observation's value, ``Box``
action clipping, gSDE noise resampling).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.buffers import PreallocatedRollout


class Actor(Protocol):
    """What the collection loop needs from an actor."""

    def act(self, obs: Any) -> tuple[np.ndarray, th.Tensor, th.Tensor]: ...

    def predict_values(self, obs: Any) -> th.Tensor: ...

    def env_actions(self, actions: np.ndarray) -> np.ndarray: ...

    def reset_noise(self, n_envs: int) -> None: ...


def stack_observations(observations: list[Any]) -> Any:
    """:return: single observations (arrays or dicts of arrays) stacked into one batch"""
    if isinstance(observations[0], dict):
        return {key: np.stack([obs[key] for obs in observations]) for key in observations[0]}
    return np.stack(observations)


def bootstrap_timeouts(
    actor: Actor, rewards: np.ndarray, dones: np.ndarray, infos: list[dict[str, Any]], gamma: float
) -> tuple[np.ndarray, Any, np.ndarray] | None:
    """
    Add ``gamma * V(terminal observation)`` to the rewards of episodes cut by a time limit (SB3 issue #633), with
    one batched value call for all of them.

    :return: ``(env indices, their terminal observations, the added bootstrap)``, or ``None`` when there were none
    """
    envs = [
        i
        for i in np.flatnonzero(dones)
        if infos[i].get("terminal_observation") is not None and infos[i].get("TimeLimit.truncated", False)
    ]
    if not envs:
        return None
    terminal_obs = stack_observations([infos[i]["terminal_observation"] for i in envs])
    index = np.asarray(envs)
    bootstrap = (gamma * actor.predict_values(terminal_obs)).cpu().numpy()
    rewards[index] += bootstrap
    return index, terminal_obs, bootstrap


def collect_rollout(
    model: BaseAlgorithm,
    env: VecEnv,
    callback: BaseCallback,
    rollout_buffer: PreallocatedRollout,
    n_rollout_steps: int,
    actor: Actor,
    gamma: float,
) -> bool:
    """
    Fill ``rollout_buffer`` with ``n_rollout_steps`` steps of every env and compute its advantages
    (``OnPolicyAlgorithm.collect_rollouts`` with a lean actor).

    :param model: the algorithm (its ``_last_obs``, ``num_timesteps``, info buffers and gSDE settings are used)
    :param env: the training env
    :param callback: called once per vectorised step
    :param rollout_buffer: the buffer to fill
    :param n_rollout_steps: steps per env
    :param actor: acts for all envs at once
    :param gamma: discount of the timeout bootstrap
    :return: ``False`` when a callback stopped training
    """
    self = model  # callbacks may read ``locals()["self"]``, as in SB3's loop
    assert self._last_obs is not None, "No previous observation was provided"
    self.policy.set_training_mode(False)
    n_steps = 0
    rollout_buffer.reset()
    if self.use_sde:
        actor.reset_noise(env.num_envs)
    callback.on_rollout_start()
    while n_steps < n_rollout_steps:
        if self.use_sde and self.sde_sample_freq > 0 and n_steps % self.sde_sample_freq == 0:
            actor.reset_noise(env.num_envs)
        actions, values, log_probs = actor.act(self._last_obs)
        clipped_actions = actor.env_actions(actions)
        new_obs, rewards, dones, infos = env.step(clipped_actions)
        self.num_timesteps += env.num_envs
        callback.update_locals(locals())
        if not callback.on_step():
            return False
        self._update_info_buffer(infos, dones)
        n_steps += 1
        timeouts = bootstrap_timeouts(actor, rewards, dones, infos, gamma)
        if timeouts is not None:
            rollout_buffer.add_timeouts(*timeouts)
        rollout_buffer.add(self._last_obs, actions, rewards, self._last_episode_starts, values, log_probs)
        self._last_obs = new_obs  # type: ignore[assignment]
        self._last_episode_starts = dones
    values = actor.predict_values(new_obs)
    rollout_buffer.set_last_observations(new_obs)
    rollout_buffer.compute_returns_and_advantage(last_values=values, dones=dones)
    callback.update_locals(locals())
    callback.on_rollout_end()
    return True
