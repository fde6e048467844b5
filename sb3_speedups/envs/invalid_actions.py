"""
sb3-contrib's masking test envs (``sb3_contrib.common.envs``) as gymnasium ids, so the CLI and the benchmark can
name them. Their ``Discrete`` / ``MultiDiscrete`` observations are one-hot encoded (``FlattenObservation``), which
is what SB3's preprocessing feeds the policy anyway, so that the observation is a flat ``Box``.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
from gymnasium.wrappers import FlattenObservation

#: id -> (class name in ``sb3_contrib.common.envs``, constructor arguments)
INVALID_ACTION_ENVS: dict[str, tuple[str, dict[str, Any]]] = {
    "InvalidActionEnvDiscrete-v0": ("InvalidActionEnvDiscrete", dict(dim=10, ep_length=100, n_invalid_actions=6)),
    "InvalidActionEnvMultiDiscrete-v0": (
        "InvalidActionEnvMultiDiscrete",
        dict(dims=[5, 5, 5], ep_length=100, n_invalid_actions=9),
    ),
}


def make_invalid_action_env(env_id: str, one_hot: bool = True, **kwargs: Any) -> gym.Env:
    """
    :param env_id: one of :data:`INVALID_ACTION_ENVS`
    :param one_hot: observations one-hot as a flat ``Box`` (its ``action_masks()`` is reached through the wrapper);
        ``False``: sb3-contrib's own ``Discrete`` / ``MultiDiscrete`` observations
    :param kwargs: overrides of its constructor arguments
    :return: the env
    """
    # imported on use: sb3-contrib takes seconds to import, too long for every ``import sb3_speedups``
    import sb3_contrib.common.envs

    name, defaults = INVALID_ACTION_ENVS[env_id]
    env = getattr(sb3_contrib.common.envs, name)(**{**defaults, **kwargs})
    return FlattenObservation(env) if one_hot else env
