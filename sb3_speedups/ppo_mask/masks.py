"""Reading the envs' action masks once per vectorised step."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
from sb3_contrib.common.maskable.utils import EXPECTED_METHOD_NAME, get_action_masks
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecEnvWrapper


def _in_process_envs(env: VecEnv) -> DummyVecEnv | None:
    """:return: the ``DummyVecEnv`` under ``env`` when every wrapper above it passes ``env_method`` down unchanged"""
    while isinstance(env, VecEnvWrapper):
        if type(env).env_method is not VecEnvWrapper.env_method:
            return None
        env = env.venv
    return env if type(env).env_method is DummyVecEnv.env_method and isinstance(env, DummyVecEnv) else None


def masks_reader(env: VecEnv) -> Callable[[], np.ndarray]:
    """
    :param env: the training env (its envs expose ``action_masks()``, directly or through ``ActionMasker``)
    :return: a function returning the envs' current masks stacked, as sb3-contrib's ``get_action_masks(env)``.
        For in-process envs each env's ``action_masks`` is looked up through its wrappers once, here, rather than
        at every step (the lookup costs more than most masks); other envs are asked through ``env_method``.
    """
    dummy = _in_process_envs(env)
    if dummy is None:
        return partial(get_action_masks, env)
    methods = [e.get_wrapper_attr(EXPECTED_METHOD_NAME) for e in dummy.envs]
    # np.array stacks equally shaped masks as np.stack does (and refuses ragged ones too), at a fraction of its cost
    # for masks given as lists
    return lambda: np.array([method() for method in methods])
