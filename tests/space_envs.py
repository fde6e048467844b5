"""Small real envs over every action space and observation kind, and the seeded env factories of the AlgoCases."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import gymnasium as gym
import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env
from sb3_contrib.common.envs import InvalidActionEnvDiscrete
from stable_baselines3.common.envs import BitFlippingEnv, SimpleMultiObsEnv
from stable_baselines3.common.preprocessing import get_flattened_obs_dim
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
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


class CodeObsEnv(BoxObsEnv):
    """
    :class:`BoxObsEnv`'s episodes with ``Discrete``, ``MultiDiscrete`` or ``MultiBinary`` observations (SB3 one-hot
    encodes the first two) and ``Discrete(3)`` actions, rewarded for naming the observation's sum modulo 3.
    """

    def __init__(
        self, observation_space: spaces.Space, episode_length: int = 12, action_space: spaces.Space | None = None
    ) -> None:
        super().__init__(action_space or spaces.Discrete(3), episode_length)
        self.observation_space = observation_space

    def _observe(self):
        space = self.observation_space
        if isinstance(space, spaces.Discrete):
            return int(self.np_random.integers(space.n))
        if isinstance(space, spaces.MultiDiscrete):
            return self.np_random.integers(space.nvec).astype(space.dtype)
        return self.np_random.integers(0, 2, space.shape).astype(space.dtype)

    def step(self, action):
        self.t += 1
        code = int(np.sum(self.state)) % 3
        if isinstance(self.action_space, spaces.Box):  # continuous actions: aim their sum at the code
            reward = -abs(float(np.sum(action)) - (code - 1))
        else:
            reward = float(int(action) == code)
        self.state = self._observe()
        return self.state, reward, False, self.t >= self.episode_length, {}


OBSERVATION_SPACES = {
    "obs_discrete": spaces.Discrete(7),
    "obs_multidiscrete": spaces.MultiDiscrete([3, 5, 2]),
    "obs_multibinary": spaces.MultiBinary(6),
}


def code_env(name: str, n_envs: int = 4, seed: int = 0) -> VecEnv:
    """:return: seeded :class:`CodeObsEnv` envs with the observation space :data:`OBSERVATION_SPACES` names"""
    return make_vec_env(lambda: CodeObsEnv(OBSERVATION_SPACES[name]), n_envs=n_envs, seed=seed)


class DictObsEnv(CodeObsEnv):
    """
    :class:`CodeObsEnv` with ``Dict`` observations of vector entries (``MultiInputPolicy``'s ``CombinedExtractor``
    flattens each, one-hot encoding the ``Discrete`` and ``MultiDiscrete`` ones), the reward counting their codes.
    """

    def __init__(self, episode_length: int = 12, codes: bool = True) -> None:
        entries: dict[str, spaces.Space] = {
            "state": spaces.Box(-1, 1, (2, 2), np.float32),
            "goal": spaces.Box(-1, 1, (3,), np.float64),
            "flags": spaces.MultiBinary(2),
        }
        if codes:  # (sb3-contrib's recurrent policies cannot size their LSTM for these: numpy integers)
            entries.update(mode=spaces.Discrete(4), code=spaces.MultiDiscrete([3, 2]))
        super().__init__(spaces.Dict(entries), episode_length)

    def _observe(self):
        rng = self.np_random
        obs = {
            "state": rng.uniform(-1, 1, (2, 2)).astype(np.float32),
            "goal": rng.uniform(-1, 1, 3),
            "flags": rng.integers(0, 2, 2).astype(np.int8),
        }
        if "mode" in self.observation_space.spaces:
            obs.update(mode=int(rng.integers(4)), code=rng.integers([3, 2]))
        return obs

    def step(self, action):
        self.t += 1
        codes = int(self.state.get("mode", 0)) + int(np.sum(self.state.get("code", self.state["flags"])))
        reward = float(int(action) == codes % 3)
        self.state = self._observe()
        return self.state, reward, False, self.t >= self.episode_length, {}


def dict_envs(n_envs: int = 4, seed: int = 3, episode_length: int = 6, codes: bool = True) -> Callable[[], VecEnv]:
    """:return: a factory of seeded :class:`DictObsEnv` envs (short episodes: starts and timeouts in a rollout)"""
    return lambda: make_vec_env(lambda: DictObsEnv(episode_length, codes), n_envs=n_envs, seed=seed)


def bit_flipping_envs(continuous: bool, n_envs: int = 1) -> Callable[[], VecEnv]:
    """:return: a factory of SB3's goal env (``Dict`` of achieved / desired goals; HER relabels its goals), seeded"""
    return lambda: make_vec_env(lambda: BitFlippingEnv(n_bits=4, continuous=continuous, max_steps=4), n_envs=n_envs, seed=3)


ROLLOUT_CASES = [*ACTION_SPACES, *OBSERVATION_SPACES, "cartpole", "cartpole_fallback", "box_sde", "dict", "image"]


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
    if name in OBSERVATION_SPACES:
        return lambda: code_env(name), "MlpPolicy", {}
    return lambda: box_env(name), "MlpPolicy", {}


# --- seeded factories of the envs that the AlgoCases of tests/algo_cases.py learn on ---


def seeded_envs(env_id: str, n_envs: int, seed: int, max_episode_steps: int | None = None) -> Callable[[], VecEnv]:
    """
    :param max_episode_steps: a short time limit, so that a short rollout holds episode starts and timeout
        bootstraps
    :return: a factory of equal, seeded vectorised envs
    """
    if max_episode_steps is None:
        return lambda: make_vec_env(env_id, n_envs=n_envs, seed=seed)
    return lambda: make_vec_env(lambda: gym.make(env_id, max_episode_steps=max_episode_steps), n_envs=n_envs, seed=seed)


def dqn_env(n_envs: int) -> Callable[[], VecEnv]:
    return seeded_envs("CartPole-v1", n_envs, 3)


def image_env(action_space: spaces.Box) -> Callable[[], VecEnv]:
    """:return: a factory of small seeded uint8-image envs (CNN policies)"""
    return lambda: make_vec_env(lambda: BoxObsEnv(action_space, image=True), n_envs=2, seed=1)


def dict_pendulum_env() -> VecEnv:
    """:return: Pendulum with its observation in a ``Dict`` (``MultiInputPolicy``), seeded"""

    def make() -> gym.Env:
        env = gym.make("Pendulum-v1", max_episode_steps=20)
        space = gym.spaces.Dict({"state": env.observation_space})
        return gym.wrappers.TransformObservation(env, lambda obs: {"state": obs}, space)

    return make_vec_env(make, n_envs=2, seed=3)


def masked_env(env_id: str) -> Callable[[], VecEnv]:
    """:return: a factory of sb3-contrib's masking test env (short episodes: starts inside one rollout)"""
    return lambda: make_vec_env(lambda: gym.make(env_id, ep_length=5), n_envs=4, seed=3)


def masked_discrete_obs_env(dim: int, n_invalid_actions: int) -> Callable[[], VecEnv]:
    """:return: a factory of sb3-contrib's ``InvalidActionEnvDiscrete``, whose observations are ``Discrete(dim)``"""
    return lambda: make_vec_env(
        lambda: InvalidActionEnvDiscrete(dim=dim, ep_length=5, n_invalid_actions=n_invalid_actions), n_envs=4, seed=3
    )


def code_envs(name: str, seed: int = 3, continuous: bool = False, n_envs: int = 4) -> Callable[[], VecEnv]:
    """
    :param continuous: ``Box(-1, 1, (2,))`` actions instead of ``Discrete(3)``
    :return: a factory of seeded :func:`code_env` envs (episodes of 6 steps: starts and timeouts in a rollout)
    """
    space = OBSERVATION_SPACES[name]
    actions = spaces.Box(-1, 1, (2,), np.float32) if continuous else spaces.Discrete(3)
    return lambda: make_vec_env(lambda: CodeObsEnv(space, episode_length=6, action_space=actions), n_envs=n_envs, seed=seed)


class BatchNormExtractor(BaseFeaturesExtractor):
    """Flat observations through BatchNorm and Dropout: running statistics, and RNG draws in training mode only."""

    def __init__(self, observation_space: gym.Space) -> None:
        super().__init__(observation_space, get_flattened_obs_dim(observation_space))
        self.net = th.nn.Sequential(th.nn.Flatten(), th.nn.BatchNorm1d(self.features_dim), th.nn.Dropout(0.2))

    def forward(self, observations: th.Tensor) -> th.Tensor:
        return self.net(observations)
