"""
The timeout bootstrap of on-policy collection (SB3 issue #633), for every truncated episode of a vectorised step at
once: ``gamma * V(terminal observation)`` is added to its reward, with one batched value call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch as th


def stack_observations(observations: list[Any]) -> Any:
    """:return: single observations (arrays or dicts of arrays) stacked into one batch"""
    if isinstance(observations[0], dict):
        return {key: np.stack([obs[key] for obs in observations]) for key in observations[0]}
    return np.stack(observations)


@dataclass
class Timeouts:
    """The episodes of one vectorised step that a time limit cut."""

    #: the envs whose episode was truncated
    envs: np.ndarray
    #: their terminal observations, batched
    observations: Any
    #: ``gamma * V(observations)``, already added to their rewards
    bootstrap: np.ndarray


def bootstrap_timeouts(
    rewards: np.ndarray,
    dones: np.ndarray,
    infos: list[dict[str, Any]],
    gamma: float,
    values_of: Callable[[np.ndarray, Any], th.Tensor],
) -> Timeouts | None:
    """
    Add ``gamma * V(terminal observation)`` to the rewards (in place) of the episodes cut by a time limit.

    :param rewards: the step's rewards ``[n_envs]``
    :param dones: the step's dones
    :param infos: the step's infos (``terminal_observation``, ``TimeLimit.truncated``)
    :param gamma: discount factor
    :param values_of: ``(env indices, their batched terminal observations) -> values`` (``n`` values, any shape)
    :return: what was bootstrapped, or ``None`` when no episode was truncated
    """
    if not dones.any():
        return None
    envs = [
        i
        for i in np.flatnonzero(dones)
        if infos[i].get("terminal_observation") is not None and infos[i].get("TimeLimit.truncated", False)
    ]
    if not envs:
        return None
    index = np.asarray(envs)
    observations = stack_observations([infos[i]["terminal_observation"] for i in envs])
    bootstrap = (gamma * values_of(index, observations)).flatten().cpu().numpy()
    rewards[index] += bootstrap
    return Timeouts(index, observations, bootstrap)
