"""
``MaskedKnapsack-v0``: fill a knapsack one item at a time, a combinatorial problem where most actions become invalid
as the episode goes on, so masking matters far more than in sb3-contrib's identity envs.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class MaskedKnapsackEnv(gym.Env[np.ndarray, np.int64]):
    """
    Each episode draws ``n_items`` items (values in ``[0, 1)``, weights in ``[0.05, 0.35)``) and a knapsack of
    capacity 1; each step picks one item and earns its value. An item already taken or heavier than the remaining
    capacity is invalid (:meth:`action_masks`); picking one anyway ends the episode without reward. The episode ends
    when no item fits.

    Observation: the values, the weights, the taken flags and the remaining capacity (``3 * n_items + 1`` floats).

    :param n_items: number of items (actions)
    """

    metadata: dict[str, Any] = {"render_modes": []}  # noqa: RUF012  (gymnasium's own annotation)

    def __init__(self, n_items: int = 20) -> None:
        self.n_items = n_items
        self.action_space = spaces.Discrete(n_items)
        self.observation_space = spaces.Box(0.0, 1.0, (3 * n_items + 1,), dtype=np.float32)
        self._obs = np.zeros(3 * n_items + 1, dtype=np.float32)
        self._values, self._weights, self._taken = (self._obs[i * n_items : (i + 1) * n_items] for i in range(3))

    def _remaining(self) -> float:
        return float(self._obs[-1])

    def action_masks(self) -> np.ndarray:
        """:return: which items may be picked now (not taken, and fitting in the remaining capacity)"""
        return (self._taken == 0) & (self._weights <= self._remaining())

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._values[:] = self.np_random.uniform(0.0, 1.0, self.n_items)
        self._weights[:] = self.np_random.uniform(0.05, 0.35, self.n_items)
        self._taken[:] = 0.0
        self._obs[-1] = 1.0
        return self._obs.copy(), {}

    def step(self, action: np.int64 | int) -> tuple[np.ndarray, float, bool, bool, dict]:
        item = int(action)
        if not self.action_masks()[item]:
            return self._obs.copy(), 0.0, True, False, {"invalid_action": True}
        self._taken[item] = 1.0
        self._obs[-1] -= self._weights[item]
        done = not self.action_masks().any()
        return self._obs.copy(), float(self._values[item]), done, False, {}
