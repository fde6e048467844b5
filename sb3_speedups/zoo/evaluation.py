"""Deterministic evaluation with plain-float results."""

from __future__ import annotations

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import VecEnv


def evaluate(model: BaseAlgorithm, env: VecEnv, n_episodes: int, deterministic: bool = True) -> tuple[float, float]:
    """
    :param model: the agent
    :param env: the evaluation env
    :param n_episodes: episodes to run
    :param deterministic: deterministic actions
    :return: mean and standard deviation of the episode returns
    """
    mean, std = evaluate_policy(model, env, n_eval_episodes=n_episodes, deterministic=deterministic)
    return float(mean), float(std)  # type: ignore[arg-type]
