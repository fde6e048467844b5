"""
The minibatches of one SAC/TD3 ``train()`` call, laid out once for the hand-derived steps: per gradient step, the
actor's input (observations then next observations, one forward), the critics' inputs ``[obs, actions]`` (the
actions of the minibatch, and columns that each step fills with the actor's actions) and the TD target's terms.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch as th
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from sb3_speedups.common.nn.inputs import FloatRows


@dataclass
class OffPolicyBatches:
    """``steps`` minibatches of ``batch_size`` rows each (index ``[k]`` for step ``k``)."""

    batch_size: int
    #: ``[steps, 2 * batch_size, obs_dim]``: the observations, then the next observations
    actor_inputs: th.Tensor
    #: ``[steps, batch_size, obs_dim + action_dim]``: observations and the minibatch's actions
    critic_inputs: th.Tensor
    #: the observations, and action columns for the actor's actions (the actor loss)
    actor_critic_inputs: th.Tensor
    #: the next observations, and action columns for the next actions (the TD target)
    next_critic_inputs: th.Tensor
    #: ``[steps, batch_size, 1]``
    rewards: th.Tensor
    #: ``(1 - dones) * discounts`` ``[steps, batch_size, 1]``
    discounts: th.Tensor
    #: the actions ``[steps, batch_size, action_dim]``
    actions: th.Tensor


def lay_out(
    data: ReplayBufferSamples, steps: int, batch_size: int, gamma: float, rows: FloatRows | None = None
) -> OffPolicyBatches:
    """
    :param data: ``steps`` minibatches, concatenated (:func:`~sb3_speedups.common.replay.sampling.sample_minibatches`)
    :param steps: the number of minibatches
    :param batch_size: rows per minibatch
    :param gamma: the discount when the buffer gives none (n-step buffers give one per row)
    :param rows: the observations' float rows (``Dict``, ``Discrete``...), ``None`` for a flat ``Box``'s
    """
    shape = (steps, batch_size, -1)
    if rows is None:
        obs = data.observations.reshape(shape).float()
        next_obs = data.next_observations.reshape(shape).float()
    else:
        obs = rows.rows(data.observations, data.actions.device).reshape(shape)
        next_obs = rows.rows(data.next_observations, data.actions.device).reshape(shape)
    actions = data.actions.reshape(shape).float()
    critic_inputs = th.cat([obs, actions], dim=2)
    discounts = data.discounts if data.discounts is not None else gamma
    return OffPolicyBatches(
        batch_size,
        th.cat([obs, next_obs], dim=1),
        critic_inputs,
        critic_inputs.clone(),
        th.cat([next_obs, th.empty_like(actions)], dim=2),
        data.rewards.reshape(shape),
        ((1 - data.dones) * discounts).reshape(shape),
        actions,
    )
