"""
Trials within their budget. Algorithms train in whole rollouts (on-policy: ``n_steps * n_envs`` env steps; off-policy:
``train_freq * n_envs``), so a trial trains the largest whole number of them that fits its budget, and the search
space may only offer rollouts that fit between two evaluations: each evaluation then sees at least one more update.
"""

from __future__ import annotations

import inspect
from typing import Any

from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.on_policy_algorithm import OnPolicyAlgorithm

from sb3_speedups.errors import UserError
from sb3_speedups.tune.search_space import Param, SearchSpace


def default_value(algo_cls: type, name: str) -> Any:
    """:return: the default of constructor argument ``name`` (following ``**kwargs`` up the MRO), ``None`` if none"""
    for klass in algo_cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None:
            continue
        parameter = inspect.signature(init).parameters.get(name)
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return None


def rollout_steps(algo_cls: type, hyperparams: dict[str, Any]) -> int | None:
    """
    :param algo_cls: the algorithm class
    :param hyperparams: a trial's merged hyperparameters
    :return: env steps collected between two updates, ``None`` where it is not a fixed number (episodes)
    """
    n_envs = int(hyperparams.get("n_envs", 1))
    if issubclass(algo_cls, OnPolicyAlgorithm):
        return int(hyperparams.get("n_steps", default_value(algo_cls, "n_steps"))) * n_envs
    if issubclass(algo_cls, OffPolicyAlgorithm):
        train_freq = hyperparams.get("train_freq", default_value(algo_cls, "train_freq"))
        if isinstance(train_freq, (list, tuple)):
            train_freq = train_freq[0] if len(train_freq) == 2 and train_freq[1] == "step" else None
        return int(train_freq) * n_envs if isinstance(train_freq, int) and train_freq > 0 else None
    return None


def trial_budget(n_timesteps: int, rollout: int | None) -> int:
    """:return: the env steps of the whole rollouts that fit in ``n_timesteps`` (at least one rollout)"""
    if rollout is None or rollout <= 0:
        return n_timesteps
    return max(n_timesteps // rollout, 1) * rollout


def max_rollout(n_timesteps: int, n_evaluations: int, eval_freq: int) -> int:
    """:return: the largest rollout that leaves at least one update between two evaluations"""
    if eval_freq > 0:
        return min(eval_freq, n_timesteps)
    return n_timesteps // max(min(n_evaluations, n_timesteps), 1)


def _largest(space: SearchSpace, name: str, fallback: Any) -> Any:
    if name in space.params:
        param = space.params[name]
        return max(param.choices) if param.choices is not None else param.high
    return space.fixed.get(name, fallback)


def fit_n_steps(space: SearchSpace, algo_cls: type, base: dict[str, Any], limit: int) -> SearchSpace:
    """
    Drop the ``n_steps`` choices of a built-in on-policy space whose rollout would not fit between two evaluations.

    :param space: the built-in space
    :param algo_cls: the algorithm class
    :param base: the fixed hyperparameters (for ``n_envs``)
    :param limit: :func:`max_rollout`
    :return: the space, with only the choices that fit (unchanged where there is nothing to fit)
    """
    param = space.params.get("n_steps")
    if not issubclass(algo_cls, OnPolicyAlgorithm) or param is None or param.choices is None:
        return space
    n_envs = int(_largest(space, "n_envs", base.get("n_envs", 1)))
    fitting = tuple(n for n in param.choices if n * n_envs <= limit)
    if not fitting:
        raise UserError(
            f"the budget leaves {limit} env steps between two evaluations, less than the smallest rollout "
            f"(n_steps {min(param.choices)} x {n_envs} envs): raise -n, or lower --n-evaluations or n_envs"
        )
    return SearchSpace({**space.params, "n_steps": Param("n_steps", choices=fitting)}, space.fixed, space.constraints)


def check_rollouts_fit(space: SearchSpace, algo_cls: type, base: dict[str, Any], limit: int) -> None:
    """
    Refuse (one line) a space in which some trial would collect more env steps per rollout than there are between
    two evaluations: it would train past its evaluations, or past its budget.

    :param space: the final search space
    :param algo_cls: the algorithm class
    :param base: the fixed hyperparameters
    :param limit: :func:`max_rollout`
    """
    if not issubclass(algo_cls, OnPolicyAlgorithm):
        return
    n_steps = _largest(space, "n_steps", base.get("n_steps", default_value(algo_cls, "n_steps")))
    n_envs = _largest(space, "n_envs", base.get("n_envs", 1))
    if isinstance(n_steps, (int, float)) and isinstance(n_envs, (int, float)) and n_steps * n_envs > limit:
        raise UserError(
            f"n_steps up to {n_steps} x {n_envs} envs = {int(n_steps * n_envs)} env steps per rollout, more than the "
            f"{limit} between two evaluations: lower n_steps in the search space or the YAML, or raise -n, or lower "
            "--n-evaluations"
        )
