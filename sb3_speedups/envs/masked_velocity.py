"""Velocity-masked versions of standard envs (the RL Zoo's ``CartPoleNoVel-v1`` and friends)."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np

# Observation entries that are velocities, per env (from each env's documented observation layout).
VELOCITY_INDICES: dict[str, list[int]] = {
    "CartPole-v1": [1, 3],
    "MountainCar-v0": [1],
    "MountainCarContinuous-v0": [1],
    "Pendulum-v1": [2],
    "LunarLander-v3": [2, 3, 5],
    "LunarLanderContinuous-v3": [2, 3, 5],
}


class MaskVelocityWrapper(gym.ObservationWrapper):
    """
    Zero the velocity entries of the observation, keeping the observation space's shape.

    :param env: a Box-observation env listed in :data:`VELOCITY_INDICES` (or any, with ``indices``)
    :param indices: entries to mask; default: looked up from the env id
    """

    def __init__(self, env: gym.Env, indices: list[int] | None = None) -> None:
        super().__init__(env)
        if indices is None:
            env_id = env.unwrapped.spec.id if env.unwrapped.spec is not None else None
            if env_id not in VELOCITY_INDICES:
                raise ValueError(f"no velocity indices known for {env_id}; pass indices=[...]")
            indices = VELOCITY_INDICES[env_id]
        self.mask = np.ones_like(env.observation_space.sample())
        self.mask[indices] = 0

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return observation * self.mask


def make_masked_velocity_env(base_id: str, **kwargs: Any) -> gym.Env:
    """
    gymnasium entry point: ``gym.make(base_id)`` wrapped in :class:`MaskVelocityWrapper`.

    :param base_id: the env to mask, e.g. ``CartPole-v1``
    :param kwargs: passed to ``gym.make`` (``render_mode`` ...)
    :return: the masked env
    """
    return MaskVelocityWrapper(gym.make(base_id, **kwargs))
