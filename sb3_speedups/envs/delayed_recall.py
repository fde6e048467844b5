"""A small memory task: remember a cue shown only in the first observation, answer it after a delay."""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces


class DelayedRecallEnv(gym.Env[np.ndarray, np.int64]):
    """
    Observation ``[cue, query]``: the first one carries the cue (+1 or -1), the next ``delay`` are zeros, the last
    of them has ``query = 1``; the action taken then scores +1 if it equals the cue bit, else -1, and ends the
    episode. Actions before the query are ignored. A feed-forward policy sees the same query observation for
    either cue, so it stays at chance (mean return 0).

    :param delay: number of steps between the cue and the answer (>= 1)
    :param render_mode: ``None`` or ``"rgb_array"`` (SB3's ``make_vec_env`` asks for it): a 1x2-pixel image of the
        last observation, white for +1, grey for 0, black for -1
    """

    metadata: dict[str, Any] = {"render_modes": ["rgb_array"], "render_fps": 4}  # noqa: RUF012

    def __init__(self, delay: int = 4, render_mode: str | None = None) -> None:
        if delay < 1:
            raise ValueError(f"delay must be >= 1, got {delay}")
        if render_mode not in (None, "rgb_array"):
            raise ValueError(f"render_mode={render_mode!r} is not supported: use None or 'rgb_array'")
        self.delay = delay
        self.render_mode = render_mode
        self.observation_space = spaces.Box(-1.0, 1.0, shape=(2,), dtype=np.float32)
        self.action_space: spaces.Discrete = spaces.Discrete(2)
        self._cue = 0
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self._cue = int(self.np_random.integers(2))
        self._t = 0
        return self._observation(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict]:
        self._t += 1
        if self._t <= self.delay:
            return self._observation(), 0.0, False, False, {}
        reward = 1.0 if int(action) == self._cue else -1.0
        return self._observation(), reward, True, False, {}

    def _observation(self) -> np.ndarray:
        """:return: ``[cue, query]`` after ``self._t`` steps: the cue first, the query at the delay, else zeros"""
        cue = 2.0 * self._cue - 1.0 if self._t == 0 else 0.0
        return np.array([cue, 1.0 if self._t == self.delay else 0.0], dtype=np.float32)

    def render(self) -> np.ndarray | None:
        """:return: with ``render_mode="rgb_array"``, the last observation as a ``[1, 2, 3]`` uint8 image, else ``None``"""
        if self.render_mode != "rgb_array":
            return None
        grey = np.round((self._observation() + 1.0) * 127.5).astype(np.uint8)
        return np.repeat(grey[None, :, None], 3, axis=2)
