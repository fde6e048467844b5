"""
PPO ``learn()`` time with and without ``double_buffer`` on ``BatchedSubprocVecEnv``, for envs with an artificial CPU
cost per step: ``python scripts/double_buffer_bench.py 0,200,1000`` (busy-wait microseconds per env step).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import gymnasium as gym

from sb3_speedups import PPO, BatchedSubprocVecEnv, make_vec_env


class BusyStep(gym.Wrapper):
    """
    Busy-waits before every step, as an expensive simulator would compute.

    :param env: the env to wrap
    :param cost_us: microseconds of CPU per step
    """

    def __init__(self, env: gym.Env, cost_us: float = 0.0) -> None:
        super().__init__(env)
        self.cost = cost_us / 1e6

    def step(self, action: Any) -> Any:
        end = time.perf_counter() + self.cost
        while time.perf_counter() < end:
            pass
        return self.env.step(action)


def learn_seconds(cost_us: float, double_buffer: bool, n_envs: int = 16, steps: int = 32_768) -> float:
    """
    :param cost_us: busy-wait per env step
    :param double_buffer: PPO's ``double_buffer`` option
    :param n_envs: envs of the ``BatchedSubprocVecEnv``
    :param steps: training budget
    :return: seconds in ``learn()``
    """
    env = make_vec_env(
        "CartPole-v1",
        n_envs=n_envs,
        seed=0,
        vec_env_cls=BatchedSubprocVecEnv,
        wrapper_class=BusyStep,
        wrapper_kwargs=dict(cost_us=cost_us),
        env_kwargs=dict(render_mode=None),
        vec_env_kwargs=dict(start_method="fork"),
    )
    model = PPO("MlpPolicy", env, n_steps=32, batch_size=256, n_epochs=4, seed=0, double_buffer=double_buffer)
    start = time.perf_counter()
    model.learn(steps)
    seconds = time.perf_counter() - start
    env.close()
    return seconds


def main(costs: list[float]) -> None:
    """Two alternating runs of each setting per env cost; prints the best of each and their ratio."""
    for cost in costs:
        times: dict[bool, list[float]] = {False: [], True: []}
        for order in ((False, True), (True, False)):
            for double_buffer in order:
                times[double_buffer].append(learn_seconds(cost, double_buffer))
        without, with_ = min(times[False]), min(times[True])
        print(f"env cost {cost:6.0f} us/step: without {without:.2f} s, with it {with_:.2f} s: {without / with_:.2f}x")


if __name__ == "__main__":
    main([float(c) for c in sys.argv[1].split(",")])
