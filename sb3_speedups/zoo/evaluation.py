"""Deterministic evaluation with plain-float results."""

from __future__ import annotations

import sys

from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.vec_env import VecEnv

# The evaluation env's seed is the run's plus this (its episodes differ from the training env's).
EVAL_SEED_OFFSET = 1000


def is_maskable(algo_cls: type) -> bool:
    """:return: whether ``algo_cls`` is sb3-contrib's ``MaskablePPO`` (or ours): it acts on the envs' action masks"""
    maskable = sys.modules.get("sb3_contrib.ppo_mask.ppo_mask")  # loaded if algo_cls is one
    return maskable is not None and issubclass(algo_cls, maskable.MaskablePPO)


def evaluate(
    model: BaseAlgorithm, env: VecEnv, n_episodes: int, deterministic: bool = True, warn: bool = True
) -> tuple[float, float]:
    """
    :param model: the agent
    :param env: the evaluation env
    :param n_episodes: episodes to run
    :param deterministic: deterministic actions
    :param warn: warn when the env is not wrapped with a ``Monitor`` (SB3's ``evaluate_policy``)
    :return: mean and standard deviation of the episode returns (with the envs' action masks for MaskablePPO)
    """
    if is_maskable(type(model)):
        from sb3_contrib.common.maskable.evaluation import evaluate_policy as evaluate_masked

        mean, std = evaluate_masked(model, env, n_eval_episodes=n_episodes, deterministic=deterministic, warn=warn)  # type: ignore[arg-type]
        return float(mean), float(std)  # type: ignore[arg-type]
    mean, std = evaluate_policy(model, env, n_eval_episodes=n_episodes, deterministic=deterministic, warn=warn)
    return float(mean), float(std)  # type: ignore[arg-type]
