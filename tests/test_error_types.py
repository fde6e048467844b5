"""
Drop-in error types: a bad argument raises the same built-in type as stock SB3 / Python does (ours a ``UserError``
subclass of it, so that the CLI still prints one line and exits 2), and where the argument exists in stock, stock
raises that type too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
import pytest
import stable_baselines3
from stable_baselines3.common.buffers import NStepReplayBuffer
from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
from stable_baselines3.common.vec_env import DummyVecEnv, SubprocVecEnv, VecEnv

from sb3_speedups import DQN, PPO, BatchedSubprocVecEnv, make_vec_env
from sb3_speedups.common.vec_env.adapters import EnvPoolVecEnv, GymVectorVecEnv
from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo


def cartpole() -> gym.Env:
    return gym.make("CartPole-v1")


def closing(make: Callable[[], VecEnv], use: Callable[[VecEnv], object]) -> Callable[[], None]:
    """:return: a call that makes a VecEnv, calls ``use`` on it, and closes it whatever happens"""

    def call() -> None:
        env = make()
        try:
            use(env)
        finally:
            env.close()

    return call


def reset_with_options(options: object) -> Callable[[VecEnv], object]:
    def use(env: VecEnv) -> object:
        env.set_options(options)  # type: ignore[arg-type]
        return env.reset()

    return use


def same_env_twice() -> list[Callable[[], gym.Env]]:
    env = cartpole()
    return [lambda: env, lambda: env]


@dataclass(frozen=True)
class Case:
    """
    :param name: test id
    :param error: the built-in type stock raises (or Python's convention where stock has no such argument)
    :param ours: the bad call on our class
    :param stock: the same bad call on the stock class, ``None`` where stock has no such argument
    """

    name: str
    error: type[Exception]
    ours: Callable[[], object]
    stock: Callable[[], object] | None = None


def local(env_fns: list[Callable[[], gym.Env]], **kwargs) -> BatchedSubprocVecEnv:
    return BatchedSubprocVecEnv(env_fns, n_local=len(env_fns), **kwargs)


CASES = [
    Case(
        "start_method",
        ValueError,
        lambda: BatchedSubprocVecEnv([cartpole], start_method="illegal_method"),
        lambda: SubprocVecEnv([cartpole], start_method="illegal_method"),
    ),
    Case("no_env_fns", ValueError, lambda: BatchedSubprocVecEnv([]), lambda: SubprocVecEnv([])),
    Case("same_env_twice", ValueError, lambda: local(same_env_twice()), lambda: DummyVecEnv(same_env_twice())),
    Case("n_workers", ValueError, lambda: BatchedSubprocVecEnv([cartpole], n_workers=0)),
    Case("spin_us", ValueError, lambda: BatchedSubprocVecEnv([cartpole], spin_us=-1)),
    Case("n_local_range", ValueError, lambda: BatchedSubprocVecEnv([cartpole], n_local=2)),
    Case("n_local_all_with_workers", ValueError, lambda: BatchedSubprocVecEnv([cartpole], n_local=1, n_workers=1)),
    Case(
        "indices_unsorted",
        ValueError,
        closing(lambda: local([cartpole, cartpole]), lambda env: env.step_async_indices(np.zeros(2, dtype=int), [1, 0])),
    ),
    Case(
        "actions_count",
        ValueError,
        closing(lambda: local([cartpole, cartpole]), lambda env: env.step_async_indices(np.zeros(1, dtype=int), [0, 1])),
    ),
    Case(
        "make_vec_env_n_workers",
        TypeError,
        lambda: make_vec_env("CartPole-v1", 2, n_workers=2),
        lambda: sb3_make_vec_env("CartPole-v1", 2, n_workers=2),  # type: ignore[call-arg]
    ),
    Case(
        "make_vec_env_start_method",
        TypeError,
        lambda: make_vec_env("CartPole-v1", 2, start_method="fork"),
        lambda: sb3_make_vec_env("CartPole-v1", 2, start_method="fork"),  # type: ignore[call-arg]
    ),
    Case("adapter_env_callable", TypeError, lambda: make_vec_env(cartpole, 2, vec_env_cls=EnvPoolVecEnv)),
    Case(
        "adapter_wrapper_class",
        ValueError,
        lambda: make_vec_env("CartPole-v1", 2, vec_env_cls=EnvPoolVecEnv, wrapper_class=gym.Wrapper),
    ),
    Case("envpool_env_id", ValueError, lambda: EnvPoolVecEnv("NoSuchEnv-v0", 2)),
    Case(
        "envpool_reset_options",
        ValueError,
        closing(lambda: EnvPoolVecEnv("CartPole-v1", 2, seed=0), reset_with_options({"x": 1})),
    ),
    Case(
        "gym_vector_next_step_autoreset",
        ValueError,
        lambda: GymVectorVecEnv(gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")),
    ),
    Case(
        "gym_vector_options_per_env",
        ValueError,
        closing(lambda: make_vec_env("CartPole-v1", 2, vec_env_cls=GymVectorVecEnv), reset_with_options([{"x": 1}, {}])),
    ),
    Case(
        "gym_vector_set_attr_indices",
        ValueError,
        closing(
            lambda: GymVectorVecEnv(gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="vector_entry_point")),
            lambda env: env.set_attr("marker", 1, indices=[0]),
        ),
    ),
    Case("ppo_normalize_advantage", ValueError, lambda: PPO("MlpPolicy", "CartPole-v1", normalize_advantage="sometimes")),
    Case("ppo_split_update", ValueError, lambda: PPO("MlpPolicy", "CartPole-v1", split_update="sometimes")),
    Case(
        "ppo_double_buffer_env",
        ValueError,
        lambda: PPO("MlpPolicy", "CartPole-v1", n_steps=8, batch_size=8, double_buffer=True, device="cpu").learn(8),
    ),
    Case(
        "dqn_policy",
        ValueError,
        lambda: DQN("NoSuchPolicy", "CartPole-v1"),
        lambda: stable_baselines3.DQN("NoSuchPolicy", "CartPole-v1"),
    ),
    Case("dqn_dueling_policy", ValueError, lambda: DQN("NoSuchPolicy", "CartPole-v1", policy_kwargs={"dueling": True})),
    Case("dqn_per_final_beta", ValueError, lambda: DQN("MlpPolicy", "CartPole-v1", per_final_beta=2.0)),
    Case(
        "dqn_combined_replay",
        ValueError,
        lambda: DQN("MlpPolicy", "CartPole-v1", combined_replay=True, replay_buffer_class=NStepReplayBuffer),
    ),
    Case("algo_name", ValueError, lambda: get_algo("no_such_algo")),
]


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_ours_raises_the_stock_type(case: Case) -> None:
    with pytest.raises(case.error) as caught:
        case.ours()
    if case.name != "dqn_policy":  # raised by SB3 itself, before any check of ours
        assert isinstance(caught.value, UserError)


@pytest.mark.parametrize("case", [case for case in CASES if case.stock is not None], ids=lambda case: case.name)
def test_stock_raises_that_type_too(case: Case) -> None:
    assert case.stock is not None
    with pytest.raises(case.error):
        case.stock()
