"""Envs and comparisons for the VecEnv tests (a module, so spawned workers can import the env classes)."""

from __future__ import annotations

import os
import time
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium import spaces

OBS_SPACES: dict[str, spaces.Space] = {
    "box": spaces.Box(-np.inf, np.inf, (3,), np.float32),
    "image": spaces.Box(0, 255, (6, 5, 3), np.uint8),
    "int_box": spaces.Box(-10, 10, (2,), np.int32),
    "discrete": spaces.Discrete(5),
    "multi_discrete": spaces.MultiDiscrete([3, 4]),
    "multi_binary": spaces.MultiBinary(4),
    "dict": spaces.Dict({"pos": spaces.Box(-1, 1, (2,), np.float64), "mode": spaces.Discrete(3)}),
    "tuple": spaces.Tuple((spaces.Box(-1, 1, (2,), np.float32), spaces.MultiBinary(2))),
}


def draw(space: spaces.Space, rng: np.random.Generator) -> Any:
    """An observation of ``space`` drawn from the env's own RNG (so seeds decide everything)."""
    if isinstance(space, spaces.Dict):
        return {key: draw(sub, rng) for key, sub in space.spaces.items()}
    if isinstance(space, spaces.Tuple):
        return tuple(draw(sub, rng) for sub in space.spaces)
    if isinstance(space, spaces.Discrete):
        return int(rng.integers(space.n))
    if isinstance(space, spaces.MultiDiscrete):
        return rng.integers(space.nvec).astype(space.dtype)
    if isinstance(space, spaces.MultiBinary):
        return rng.integers(0, 2, space.n).astype(space.dtype)
    assert isinstance(space, spaces.Box)
    if np.issubdtype(space.dtype, np.integer):
        return rng.integers(space.low, space.high, space.shape, endpoint=True).astype(space.dtype)
    return rng.standard_normal(space.shape).astype(space.dtype)


class SpacesEnv(gym.Env):
    """
    Episodes of random length ending by termination or truncation, infos on some steps, reset infos, reset
    options, rgb rendering, and on request a failure at a given step.

    :param obs: key of :data:`OBS_SPACES`
    :param action: ``box`` or ``discrete``
    :param fail_at: raise ``ValueError`` at this step of the first episode
    :param fail_reset: raise ``ValueError`` in ``reset``
    :param delay: seconds each step sleeps (an env slow enough for workers to pay off)
    """

    metadata: ClassVar[dict[str, Any]] = {"render_modes": ["rgb_array"], "render_fps": 30}

    def __init__(
        self,
        obs: str = "box",
        action: str = "box",
        fail_at: int | None = None,
        fail_reset: bool = False,
        render_mode: str | None = None,
        delay: float = 0.0,
    ) -> None:
        self.observation_space = OBS_SPACES[obs]
        self.action_space = spaces.Box(-1, 1, (2,), np.float32) if action == "box" else spaces.Discrete(3)
        self.fail_at, self.fail_reset, self.render_mode, self.delay = fail_at, fail_reset, render_mode, delay
        self.t = 0
        self.episodes = 0
        self.offset = 0.0
        self.marker = "unset"

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        super().reset(seed=seed)
        if self.fail_reset:
            raise ValueError("reset failed on purpose")
        self.t = 0
        self.episodes += 1
        self.offset = float((options or {}).get("offset", 0.0))
        self.horizon = int(self.np_random.integers(2, 9))
        return draw(self.observation_space, self.np_random), {"draw": float(self.np_random.random()), "offset": self.offset}

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.t += 1
        if self.delay:
            time.sleep(self.delay)
        if self.fail_at is not None and self.t == self.fail_at and self.episodes == 1 and type(self) is SpacesEnv:
            raise ValueError(f"step {self.t} failed on purpose")
        obs = draw(self.observation_space, self.np_random)
        reward = float(np.sum(action)) + self.offset + float(self.np_random.random())
        over = self.t >= self.horizon
        terminated = bool(over and self.np_random.random() < 0.5)
        truncated = over and not terminated
        info: dict[str, Any] = {}
        if self.t % 3 == 0:
            # numpy scalars as MuJoCo envs report them: they must come back from workers with their types
            info = {"t": self.t, "vec": np.arange(2) * self.t, "x": np.float64(reward), "y": np.float32(self.t / 7)}
            info.update(k=np.int64(self.t), ok=np.bool_(terminated), nested={"z": np.float64(0.5)})
        return obs, reward, terminated, truncated, info

    def render(self) -> np.ndarray:
        return np.full((4, 6, 3), self.t, dtype=np.uint8)

    def add(self, a: int, b: int = 0) -> int:
        return a + b + self.t


class KillSelfEnv(SpacesEnv):
    """SIGKILLs its own process at its ``fail_at``-th step (a worker dying under the main process)."""

    total = 0

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        self.total += 1
        if self.total == self.fail_at:
            os.kill(os.getpid(), 9)
        return super().step(action)


class UnpicklableError(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a}/{b}")


class UnpicklableErrorEnv(SpacesEnv):
    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        raise UnpicklableError(1, 2)


def env_fns(n: int, **kwargs: Any) -> list:
    """``n`` functions making :class:`SpacesEnv` (``kwargs`` may hold per-env lists under ``per_env``)."""
    per_env = kwargs.pop("per_env", {})
    cls = kwargs.pop("cls", SpacesEnv)

    def make(i: int):
        return lambda: cls(**kwargs, **{key: values[i] for key, values in per_env.items()})

    return [make(i) for i in range(n)]


def random_actions(space: spaces.Space, n_envs: int, n_steps: int, seed: int = 0) -> list[np.ndarray]:
    space = gym.vector.utils.batch_space(space, n_envs)
    space.seed(seed)
    return [space.sample() for _ in range(n_steps)]


def assert_same(a: Any, b: Any, where: str = "") -> None:
    """Equal values of the same types (arrays: same dtype and shape), recursively."""
    assert type(a) is type(b), f"{where}: {type(a)} != {type(b)}"
    if isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{where}: {a.dtype}{a.shape} != {b.dtype}{b.shape}"
        np.testing.assert_array_equal(a, b, err_msg=where)
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_step(ours: tuple, ref: tuple, where: str = "") -> None:
    """Same observations, rewards, dones and infos as the reference VecEnv step."""
    for name, x, y in zip(("obs", "rewards", "dones", "infos"), ours, ref, strict=True):
        assert_same(list(x) if name == "infos" else x, list(y) if name == "infos" else y, f"{where} {name}")
