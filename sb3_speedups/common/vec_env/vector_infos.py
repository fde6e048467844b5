"""Helpers of the vector-env adapters: per-env infos from batched ones, observation rows, partial resets."""

from __future__ import annotations

from typing import Any

import numpy as np


def split_infos(info: dict[str, Any], n_envs: int) -> list[dict[str, Any]]:
    """
    Per-env info dicts from a batched one (gymnasium's ``key``/``_key`` mask layout, or EnvPool's plain arrays).

    :param info: batched infos: arrays with one row per env, nested dicts, optional ``_key`` masks
    :param n_envs: number of envs in the batch
    :return: one dict per env holding only the keys that env reported
    """
    infos: list[dict[str, Any]] = [{} for _ in range(n_envs)]
    for key, value in info.items():
        if isinstance(key, str) and key.startswith("_") and key[1:] in info:
            continue
        mask = info.get(f"_{key}")
        if isinstance(value, dict):
            parts: Any = split_infos(value, n_envs)
        elif isinstance(value, np.ndarray) and value.ndim >= 1 and len(value) == n_envs:
            parts = [row.copy() for row in value] if value.ndim > 1 else list(value)
        else:
            parts = [value] * n_envs
        for index in range(n_envs):
            if mask is None or mask[index]:
                infos[index][key] = parts[index]
    return infos


def take_obs(obs: Any, rows: Any) -> Any:
    """
    :param obs: batched observations (an array or a dict of arrays)
    :param rows: an env index or an array of them
    :return: a copy of those rows
    """
    if isinstance(obs, dict):
        return {key: np.array(value[rows]) for key, value in obs.items()}
    return np.array(obs[rows])


def write_obs(obs: Any, rows: np.ndarray, new: Any) -> None:
    """
    :param obs: batched observations to update in place
    :param rows: env indices
    :param new: their new observations, one row each
    """
    if isinstance(obs, dict):
        for key, value in obs.items():
            value[rows] = new[key]
    else:
        obs[rows] = new


def cartpole_partial_reset(env: Any, rows: np.ndarray) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """
    Reset some envs of gymnasium's numpy ``CartPoleVectorEnv`` now, drawing their states exactly as the env
    itself would at the start of its next step (same RNG calls, same order), so its episodes stay the same.

    :param env: the ``CartPoleVectorEnv``
    :param rows: the envs to reset, ascending
    :return: their observations and (empty) reset infos
    """
    env.state[:, rows] = env.np_random.uniform(low=env.low, high=env.high, size=(4, len(rows)))
    env.steps[rows] = 0
    env.prev_done[rows] = False
    return env.state.T[rows].astype(np.float32), [{} for _ in rows]
