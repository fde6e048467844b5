"""Small real envs over every action space and observation kind, for PPO-style on-policy tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import SimpleMultiObsEnv
from stable_baselines3.common.vec_env import VecEnv


class BoxObsEnv(gym.Env):
    """
    A small real env with ``Box`` observations (flat floats, or a uint8 image) for any action space; episodes are
    cut by a time limit.
    """

    def __init__(self, action_space: spaces.Space, episode_length: int = 12, image: bool = False) -> None:
        self.image = image
        if image:
            self.observation_space = spaces.Box(0, 255, (36, 36, 1), np.uint8)
        else:
            self.observation_space = spaces.Box(-1, 1, (4,), np.float32)
        self.action_space = action_space
        self.episode_length = episode_length

    def _observe(self):
        if self.image:
            return self.np_random.integers(0, 256, (36, 36, 1), dtype=np.uint8)
        return self.np_random.uniform(-1, 1, 4).astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.state = self._observe()
        return self.state, {}

    def step(self, action):
        self.t += 1
        target = float(self.state.mean()) if self.image else float(self.state.sum())
        reward = -abs(float(np.asarray(action, dtype=np.float32).sum()) - target)
        self.state = self._observe()
        return self.state, reward, False, self.t >= self.episode_length, {}


ACTION_SPACES = {
    "discrete": spaces.Discrete(3),
    "box": spaces.Box(-1, 1, (2,), np.float32),
    "box_matrix": spaces.Box(-1, 1, (2, 2), np.float32),  # stock hands the env actions shaped [n_envs, 2, 2]
    "multidiscrete": spaces.MultiDiscrete([3, 2]),
    "multibinary": spaces.MultiBinary(3),
}


def box_env(name, n_envs=4, seed=0):
    return make_vec_env(lambda: BoxObsEnv(ACTION_SPACES[name]), n_envs=n_envs, seed=seed)


ROLLOUT_CASES = [*ACTION_SPACES, "cartpole", "cartpole_fallback", "box_sde", "dict", "image"]


def rollout_case(name: str) -> tuple[Callable[[], VecEnv], str, dict[str, Any]]:
    """:return: (env factory, policy, extra kwargs of ours) of a first-rollout case"""
    if name.startswith("cartpole"):  # a short time limit: truncations bootstrap from the terminal value
        env = lambda: make_vec_env(lambda: gym.make("CartPole-v1", max_episode_steps=10), n_envs=4, seed=1)  # noqa: E731
        return env, "MlpPolicy", {"fast_update": False} if name == "cartpole_fallback" else {}
    if name == "box_sde":
        return lambda: box_env("box"), "MlpPolicy", {"use_sde": True, "sde_sample_freq": 4}
    if name == "dict":
        return lambda: make_vec_env(lambda: SimpleMultiObsEnv(random_start=True), n_envs=2, seed=1), "MultiInputPolicy", {}
    if name == "image":
        return lambda: make_vec_env(lambda: BoxObsEnv(spaces.Discrete(3), image=True), n_envs=2, seed=1), "CnnPolicy", {}
    return lambda: box_env(name), "MlpPolicy", {}
