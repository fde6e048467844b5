"""
Storing one vectorised step in a replay buffer as stock ``OffPolicyAlgorithm._store_transition`` does, without its
deep copy of the next observations on every step.

Stock deep-copies them so that patching in the terminal observations of finished episodes cannot change the
observations it returns to the caller. Buffers whose ``add`` copies what it is given keep no reference, so here the
observations are copied only on steps where some are patched, and a buffer that keeps stock ``ReplayBuffer.add``
gets each array assigned into its storage once (:func:`add_to_replay_buffer`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import DictReplayBuffer, ReplayBuffer
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecNormalize

#: stock ``add`` methods that copy their arrays into the buffer's own storage
COPYING_ADDS: set[Any] = {ReplayBuffer.add, DictReplayBuffer.add, HerReplayBuffer.add}


def copies_on_add(buffer: ReplayBuffer) -> bool:
    """
    :return: whether ``buffer.add`` (and every ``add`` it extends) copies what it is given: stock's do, and a class
        that overrides ``add`` says so with a class attribute ``add_keeps_no_references = True`` beside it
    """
    for cls in type(buffer).__mro__:
        add = cls.__dict__.get("add")
        if add is None:
            continue
        if add not in COPYING_ADDS and cls.__dict__.get("add_keeps_no_references") is not True:
            return False
        if add is ReplayBuffer.add:
            return True
    return False


def add_to_replay_buffer(
    buffer: ReplayBuffer,
    obs: np.ndarray,
    next_obs: np.ndarray,
    action: np.ndarray,
    reward: np.ndarray,
    done: np.ndarray,
    infos: list[dict[str, Any]],
) -> None:
    """
    ``ReplayBuffer.add`` for a buffer that does not override it, storing the same values: each array is assigned
    into the buffer's storage once (stock first copies each into a temporary array).
    """
    pos, n_envs = buffer.pos, buffer.n_envs
    if isinstance(buffer.observation_space, spaces.Discrete):
        obs = obs.reshape((n_envs, *buffer.obs_shape))
        next_obs = next_obs.reshape((n_envs, *buffer.obs_shape))
    buffer.observations[pos] = obs
    if buffer.optimize_memory_usage:
        buffer.observations[(pos + 1) % buffer.buffer_size] = next_obs
    else:
        buffer.next_observations[pos] = next_obs
    buffer.actions[pos] = action.reshape((n_envs, buffer.action_dim))
    buffer.rewards[pos] = reward
    buffer.dones[pos] = done
    if buffer.handle_timeout_termination:
        if n_envs == 1:  # one flag: no list to convert
            buffer.timeouts[pos, 0] = infos[0].get("TimeLimit.truncated", False)
        else:
            buffer.timeouts[pos] = [info.get("TimeLimit.truncated", False) for info in infos]
    buffer.pos = pos + 1
    if buffer.pos == buffer.buffer_size:
        buffer.full = True
        buffer.pos = 0


def _with_terminal_observations(
    next_obs: np.ndarray | dict[str, np.ndarray],
    finished: list[int],
    infos: list[dict[str, Any]],
    vec_normalize: VecNormalize | None,
) -> np.ndarray | dict[str, np.ndarray]:
    """:return: a copy of ``next_obs`` where the envs in ``finished`` hold their episode's terminal observation"""
    if isinstance(next_obs, dict):
        patched = {key: np.array(value) for key, value in next_obs.items()}
        for i in finished:
            terminal = infos[i]["terminal_observation"]
            if vec_normalize is not None:
                terminal = vec_normalize.unnormalize_obs(terminal)
            for key in patched:
                patched[key][i] = terminal[key]
        return patched
    array = np.array(next_obs)
    for i in finished:
        array[i] = infos[i]["terminal_observation"]
        if vec_normalize is not None:
            array[i] = vec_normalize.unnormalize_obs(array[i, :])
    return array


def store_transition(
    model: OffPolicyAlgorithm,
    replay_buffer: ReplayBuffer,
    buffer_action: np.ndarray,
    new_obs: np.ndarray | dict[str, np.ndarray],
    reward: np.ndarray,
    dones: np.ndarray,
    infos: list[dict[str, Any]],
) -> None:
    """
    Add one step to ``replay_buffer`` (a buffer for which :func:`copies_on_add` holds) and advance ``model``'s last
    observations, with the effects of stock ``_store_transition``: unnormalised observations and rewards under
    ``VecNormalize``, terminal observations of finished episodes as their next observations.
    """
    vec_normalize = model._vec_normalize_env
    if vec_normalize is None:
        model._last_original_obs = model._last_obs
        next_obs, original_reward = new_obs, reward
    else:
        next_obs, original_reward = vec_normalize.get_original_obs(), vec_normalize.get_original_reward()
        original_next_obs = next_obs
    patched = False
    if np.count_nonzero(dones):
        finished = [int(i) for i in np.flatnonzero(dones) if infos[i].get("terminal_observation") is not None]
        if finished:
            next_obs, patched = _with_terminal_observations(next_obs, finished, infos, vec_normalize), True
    obs = model._last_original_obs
    if type(replay_buffer).add is ReplayBuffer.add:
        add_to_replay_buffer(replay_buffer, obs, next_obs, buffer_action, original_reward, dones, infos)  # type: ignore[arg-type]
    else:
        if isinstance(next_obs, dict) and not patched:
            # DictReplayBuffer.add replaces the Discrete entries of the dict it is given by reshaped ones: give it a
            # dict of its own (stock's deep copy), so that the observations acted on next keep their (n_envs,) shape.
            next_obs = dict(next_obs)
        replay_buffer.add(obs, next_obs, buffer_action, original_reward, dones, infos)  # type: ignore[arg-type]
    model._last_obs = new_obs  # type: ignore[assignment]
    if vec_normalize is not None:
        model._last_original_obs = original_next_obs  # type: ignore[assignment]
