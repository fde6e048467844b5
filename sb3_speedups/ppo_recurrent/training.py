"""
RecurrentPPO's minibatch loss as sb3-contrib computes it, without host syncs.

sb3-contrib takes masked means with boolean indexing (``x[mask].mean()``) and calls ``.item()`` four times per
minibatch. Here the padding mask multiplies instead (the same means: padded entries are excluded, up to float
rounding), and the loss is PPO's (:func:`~sb3_speedups.common.on_policy.ppo_loss.ppo_loss`) with those masked means, its
statistics a tensor row per minibatch in PPO's layout. Adam is one fused step over one flat gradient buffer
(:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep`) after one norm for the clipping.
"""

from __future__ import annotations

import torch as th
from sb3_contrib.common.recurrent.type_aliases import RecurrentRolloutBufferSamples
from torch import nn

from sb3_speedups.common.on_policy.ppo_loss import PPOLossConfig, ppo_loss


def masked_mean(x: th.Tensor, mask: th.Tensor, count: th.Tensor) -> th.Tensor:
    """:return: the mean of ``x`` where ``mask`` is 1 (``count`` = ``mask.sum()``)"""
    return (x * mask).sum() / count


def recurrent_ppo_loss(
    policy: nn.Module, data: RecurrentRolloutBufferSamples, cfg: PPOLossConfig, normalize_advantage: bool, discrete: bool
) -> tuple[th.Tensor, th.Tensor]:
    """
    sb3-contrib's ``RecurrentPPO`` loss of one padded minibatch.

    :param policy: the recurrent policy
    :param data: the minibatch from the rollout buffer
    :param cfg: coefficients
    :param normalize_advantage: normalise the advantages over the minibatch's real (unpadded) entries
    :param discrete: whether the actions are ``Discrete`` (sent as ``long`` indices)
    :return: the loss and its statistics row (:data:`~sb3_speedups.common.on_policy.ppo_loss.STATS`), detached
    """
    actions = data.actions.long().flatten() if discrete else data.actions
    mask = data.mask
    count = mask.sum()
    values, log_prob, entropy = policy.evaluate_actions(data.observations, actions, data.lstm_states, data.episode_starts)  # type: ignore[operator]
    advantages = data.advantages
    if normalize_advantage:
        mean = masked_mean(advantages, mask, count)
        std = (((advantages - mean) * mask).square().sum() / (count - 1)).sqrt()
        advantages = (advantages - mean) / (std + 1e-8)
    return ppo_loss(
        log_prob,
        entropy,
        values.flatten(),
        data.old_log_prob,
        advantages,
        data.old_values,
        data.returns,
        cfg,
        mean=lambda x: masked_mean(x, mask, count),
        value_loss=lambda returns, values_pred: masked_mean((returns - values_pred) ** 2, mask, count),
    )
