"""
SB3's ``HerReplayBuffer`` sampled many minibatches at a time, with stock's draws.

Stock's ``sample`` scans the whole ``ep_length`` array for the transitions of finished episodes on every call (two
passes over ``buffer_size * n_envs`` integers: most of a call at a million transitions), gathers the real and the
relabelled rows key by key, and asks the env to recompute the relabelled rewards once per minibatch. Here the valid
transitions are kept until an ``add`` can have changed them (an episode ended, or a full buffer overwrote one), the
draws of ``n`` minibatches are made in stock's order from the same global numpy RNG (``choice``, then the goals'
``randint``, minibatch after minibatch), and the rows of all of them are gathered, relabelled, rewarded
(``compute_reward`` once, on every relabelled row: goal-conditioned rewards are computed row by row) and normalised
at once.
"""

from __future__ import annotations

import copy
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th
from stable_baselines3.common.type_aliases import DictReplayBufferSamples
from stable_baselines3.common.vec_env import VecNormalize
from stable_baselines3.her.goal_selection_strategy import GoalSelectionStrategy
from stable_baselines3.her.her_replay_buffer import HerReplayBuffer

from sb3_speedups.common.replay.rows import take_rows


@dataclass
class _ValidTransitions:
    """``np.flatnonzero(buffer.ep_length > 0)``, and the buffer's state when it was computed."""

    indices: np.ndarray
    pos: int
    #: ``_current_ep_start`` then: it moves whenever an episode's length is written (an episode ended or was cut)
    current_ep_start: np.ndarray
    #: the buffer's ``ep_length`` array (replaced when a buffer is loaded)
    ep_length: np.ndarray
    #: whether no transition from ``pos`` on belongs to an episode (so that adds overwrite none until the end)
    clean_tail: bool


_valid: weakref.WeakKeyDictionary[HerReplayBuffer, _ValidTransitions] = weakref.WeakKeyDictionary()


def valid_transitions(buffer: HerReplayBuffer) -> np.ndarray:
    """
    :return: the flat indices (over ``[buffer_size, n_envs]``) of the transitions of finished episodes, as stock's
        ``sample`` computes them; recomputed only after a change of ``ep_length``: an ``add`` ends an episode (or
        ``truncate_last_trajectory`` cuts one), or overwrites one (a full buffer, or one ``reset`` with episodes ahead)
    """
    kept = _valid.get(buffer)
    if (
        kept is not None
        and kept.ep_length is buffer.ep_length
        and kept.clean_tail
        and not buffer.full
        and buffer.pos >= kept.pos
        and np.array_equal(kept.current_ep_start, buffer._current_ep_start)
    ):
        kept.pos = buffer.pos
        return kept.indices
    indices = np.flatnonzero(buffer.ep_length > 0)
    clean_tail = not buffer.full and not buffer.ep_length[buffer.pos :].any()
    _valid[buffer] = _ValidTransitions(indices, buffer.pos, buffer._current_ep_start.copy(), buffer.ep_length, clean_tail)
    return indices


def her_sampling_supported(buffer: object) -> bool:
    """
    :return: whether :func:`sample_her_minibatches` reproduces ``buffer.sample``: a stock ``HerReplayBuffer`` whose
        relabelled goals keep the stored desired goals' dtype (stock's minibatch then has one dtype per key)
    """
    return (
        type(buffer) is HerReplayBuffer
        and buffer.observations["desired_goal"].dtype == buffer.next_observations["achieved_goal"].dtype
    )


def sample_her_minibatches(
    buffer: HerReplayBuffer, batch_size: int, n_batches: int, env: VecNormalize | None = None
) -> DictReplayBufferSamples:
    """
    ``n_batches`` minibatches, concatenated, equal to what ``n_batches`` calls of ``buffer.sample`` return.

    :param buffer: a stock ``HerReplayBuffer``
    :param batch_size: transitions per minibatch
    :param n_batches: number of minibatches
    :param env: the ``VecNormalize`` wrapper, if any
    :return: ``n_batches * batch_size`` rows: each minibatch's real transitions, then its relabelled ones
    """
    valid = valid_transitions(buffer)
    if len(valid) == 0:
        buffer.sample(batch_size, env)  # stock's error, word for word
    n_virtual = int(buffer.her_ratio * batch_size)
    positions = np.empty((n_batches, batch_size), dtype=np.int64)
    envs = np.empty((n_batches, batch_size), dtype=np.int64)
    goal_steps = np.empty((n_batches, n_virtual), dtype=np.int64)
    for i in range(n_batches):
        sampled = np.random.choice(valid, size=batch_size, replace=True)
        positions[i], envs[i] = np.unravel_index(sampled, buffer.ep_length.shape)
        goal_steps[i] = _goal_steps(buffer, positions[i, :n_virtual], envs[i, :n_virtual])
    # stock's minibatches put their real transitions first: rows [n_virtual:] then [:n_virtual] of each draw
    order = np.concatenate([np.arange(n_virtual, batch_size), np.arange(n_virtual)])
    rows = (positions * buffer.n_envs + envs)[:, order].reshape(-1)
    relabelled_rows = np.zeros((n_batches, batch_size), dtype=bool)
    relabelled_rows[:, batch_size - n_virtual :] = True
    relabelled = relabelled_rows.reshape(-1)

    obs = {key: take_rows(storage, rows) for key, storage in buffer.observations.items()}
    next_obs = {key: take_rows(storage, rows) for key, storage in buffer.next_observations.items()}
    rewards = take_rows(buffer.rewards, rows).astype(np.float32, copy=False)
    if n_virtual:
        goals = buffer.next_observations["achieved_goal"]
        goal_rows = goal_steps.reshape(-1) + take_rows(buffer.ep_start, rows[relabelled])
        goals = take_rows(goals, (goal_rows % buffer.buffer_size) * buffer.n_envs + rows[relabelled] % buffer.n_envs)
        obs["desired_goal"][relabelled] = goals
        next_obs["desired_goal"][relabelled] = goals
        rewards[relabelled] = _rewards(buffer, next_obs["achieved_goal"][relabelled], goals, rows[relabelled])
    dones = take_rows(buffer.dones, rows) * (1 - take_rows(buffer.timeouts, rows))
    obs_, next_obs_ = buffer._normalize_obs(obs, env), buffer._normalize_obs(next_obs, env)
    assert isinstance(obs_, dict) and isinstance(next_obs_, dict)
    return DictReplayBufferSamples(
        observations={key: _tensor(buffer, value) for key, value in obs_.items()},
        actions=_tensor(buffer, take_rows(buffer.actions, rows)),
        next_observations={key: _tensor(buffer, value) for key, value in next_obs_.items()},
        dones=_tensor(buffer, dones).reshape(-1, 1),
        rewards=_tensor(buffer, buffer._normalize_reward(rewards.reshape(-1, 1), env)),
    )


def _tensor(buffer: HerReplayBuffer, array: np.ndarray) -> th.Tensor:
    """:return: ``buffer.to_torch(array)`` of a fresh array (on the CPU: the array itself, wrapped; same dtype)"""
    return th.from_numpy(array) if buffer.device.type == "cpu" else buffer.to_torch(array)


def _goal_steps(buffer: HerReplayBuffer, positions: np.ndarray, envs: np.ndarray) -> np.ndarray:
    """:return: the steps in their episodes whose achieved goals relabel these transitions (stock's draws)"""
    start = buffer.ep_start[positions, envs]
    length = buffer.ep_length[positions, envs]
    strategy = buffer.goal_selection_strategy
    if strategy == GoalSelectionStrategy.FINAL:
        return length - 1
    if strategy == GoalSelectionStrategy.FUTURE:
        return np.random.randint((positions - start) % buffer.buffer_size, length)
    if strategy == GoalSelectionStrategy.EPISODE:
        return np.random.randint(0, length)
    raise ValueError(f"Strategy {strategy} for sampling goals not supported!")


def _rewards(buffer: HerReplayBuffer, achieved: np.ndarray, goals: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """:return: the env's ``compute_reward`` of the relabelled transitions (one call for all of them), float32"""
    assert buffer.env is not None, (
        "You must initialize HerReplayBuffer with a VecEnv so it can compute rewards for virtual transitions"
    )
    infos: Any = copy.deepcopy(take_rows(buffer.infos, rows)) if buffer.copy_info_dict else [{} for _ in range(len(rows))]
    rewards = buffer.env.env_method("compute_reward", achieved, goals, infos, indices=[0])
    return np.asarray(rewards[0]).astype(np.float32)
