"""
The one registry of algorithms: RL-Zoo name -> our class, the stock class and the Optuna sampler. Classes are named
by import path and imported on first use, so that ``sb3-speedups --help`` stays fast and an algorithm whose optional
dependency is missing only fails when it is asked for.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from sb3_speedups.errors import UserValueError


def import_object(path: str) -> Any:
    """
    Import ``"package.module:attribute"``.

    :param path: import path with a colon before the attribute
    :return: the attribute
    """
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class AlgoSpec:
    """
    One algorithm known to the CLI, the tuner and the benchmark.

    :param name: RL-Zoo name (``ppo``, ``dqn``, ``ppo_lstm``, ...)
    :param stock: import path of the stock SB3 / sb3-contrib class
    :param fast: import path of our faster drop-in class, ``None`` where we only run the stock one
    :param sampler: import path of the Optuna search-space function, ``None`` where there is none
    """

    name: str
    stock: str
    fast: str | None = None
    sampler: str | None = None

    def cls(self, stock: bool = False) -> type:
        """
        :param stock: force the stock class even where we have a faster one
        :return: the algorithm class
        """
        return import_object(self.stock if stock or self.fast is None else self.fast)


ALGOS: dict[str, AlgoSpec] = {
    spec.name: spec
    for spec in (
        AlgoSpec("ppo", "stable_baselines3:PPO", fast="sb3_speedups.ppo:PPO", sampler="sb3_speedups.tune.spaces:ppo_space"),
        AlgoSpec(
            "ppo_mask",
            "sb3_contrib:MaskablePPO",
            fast="sb3_speedups.ppo_mask:MaskablePPO",
            sampler="sb3_speedups.tune.spaces:ppo_space",
        ),
        AlgoSpec("dqn", "stable_baselines3:DQN", fast="sb3_speedups.dqn:DQN", sampler="sb3_speedups.tune.spaces:dqn_space"),
        AlgoSpec(
            "ppo_lstm",
            "sb3_contrib:RecurrentPPO",
            fast="sb3_speedups.ppo_recurrent:RecurrentPPO",
            sampler="sb3_speedups.tune.spaces:ppo_lstm_space",
        ),
        AlgoSpec("a2c", "stable_baselines3:A2C", fast="sb3_speedups.a2c:A2C", sampler="sb3_speedups.tune.spaces:a2c_space"),
        AlgoSpec("sac", "stable_baselines3:SAC", fast="sb3_speedups.sac:SAC", sampler="sb3_speedups.tune.spaces:sac_space"),
        AlgoSpec("td3", "stable_baselines3:TD3", fast="sb3_speedups.td3:TD3", sampler="sb3_speedups.tune.spaces:td3_space"),
        AlgoSpec(
            "ddpg", "stable_baselines3:DDPG", fast="sb3_speedups.ddpg:DDPG", sampler="sb3_speedups.tune.spaces:td3_space"
        ),
        AlgoSpec(
            "qrdqn", "sb3_contrib:QRDQN", fast="sb3_speedups.qrdqn:QRDQN", sampler="sb3_speedups.tune.spaces:qrdqn_space"
        ),
        AlgoSpec("tqc", "sb3_contrib:TQC", fast="sb3_speedups.tqc:TQC", sampler="sb3_speedups.tune.spaces:tqc_space"),
        AlgoSpec("trpo", "sb3_contrib:TRPO", fast="sb3_speedups.trpo:TRPO", sampler="sb3_speedups.tune.spaces:trpo_space"),
        AlgoSpec("ars", "sb3_contrib:ARS", fast="sb3_speedups.ars:ARS", sampler="sb3_speedups.tune.spaces:ars_space"),
        AlgoSpec(
            "crossq",
            "sb3_contrib:CrossQ",
            fast="sb3_speedups.crossq:CrossQ",
            sampler="sb3_speedups.tune.spaces:crossq_space",
        ),
    )
}


def get_algo(name: str) -> AlgoSpec:
    """
    :param name: RL-Zoo algorithm name, case-insensitive
    :return: its spec
    """
    spec = ALGOS.get(name.lower())
    if spec is None:
        raise UserValueError(f"unknown algorithm {name!r}; choose one of: {', '.join(ALGOS)}")
    return spec
