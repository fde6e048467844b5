"""
RecurrentPPO's minibatch loss as sb3-contrib computes it, without host syncs, and a flat fused optimiser step.

sb3-contrib takes masked means with boolean indexing (``x[mask].mean()``) and calls ``.item()`` four times per
minibatch. Here the padding mask multiplies instead (the same means: padded entries are excluded, up to float
rounding), the statistics stay a tensor row per minibatch, and Adam is one fused step over one flat gradient
buffer (:mod:`sb3_speedups.common.nn.optim`) after one norm for the clipping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch as th
from sb3_contrib.common.recurrent.type_aliases import RecurrentRolloutBufferSamples
from torch import nn

from sb3_speedups.common.nn.optim import FlatAdam, FlatParameters, adam_unsupported_reason

#: per-minibatch statistics, in the order of a stats row
STATS = ("policy_gradient_loss", "clip_fraction", "value_loss", "entropy_loss", "approx_kl", "loss")


@dataclass
class RecurrentLossConfig:
    """The loss's coefficients for one ``train()`` call (schedules already evaluated)."""

    clip_range: float
    clip_range_vf: float | None
    ent_coef: float
    vf_coef: float
    normalize_advantage: bool


def masked_mean(x: th.Tensor, mask: th.Tensor, count: th.Tensor) -> th.Tensor:
    """:return: the mean of ``x`` where ``mask`` is 1 (``count`` = ``mask.sum()``)"""
    return (x * mask).sum() / count


def recurrent_ppo_loss(
    policy: nn.Module, data: RecurrentRolloutBufferSamples, cfg: RecurrentLossConfig, discrete: bool
) -> tuple[th.Tensor, th.Tensor]:
    """
    sb3-contrib's ``RecurrentPPO`` loss of one padded minibatch.

    :param policy: the recurrent policy
    :param data: the minibatch from the rollout buffer
    :param cfg: coefficients
    :param discrete: whether the actions are ``Discrete`` (sent as ``long`` indices)
    :return: the loss and its statistics row (:data:`STATS`), detached
    """
    actions = data.actions.long().flatten() if discrete else data.actions
    mask = data.mask
    count = mask.sum()
    values, log_prob, entropy = policy.evaluate_actions(data.observations, actions, data.lstm_states, data.episode_starts)  # type: ignore[operator]
    values = values.flatten()
    advantages = data.advantages
    if cfg.normalize_advantage:
        mean = masked_mean(advantages, mask, count)
        std = (((advantages - mean) * mask).square().sum() / (count - 1)).sqrt()
        advantages = (advantages - mean) / (std + 1e-8)
    log_ratio = log_prob - data.old_log_prob
    ratio = th.exp(log_ratio)
    surrogate = th.min(advantages * ratio, advantages * th.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range))
    policy_loss = -masked_mean(surrogate, mask, count)
    if cfg.clip_range_vf is None:
        values_pred = values
    else:
        values_pred = data.old_values + th.clamp(values - data.old_values, -cfg.clip_range_vf, cfg.clip_range_vf)
    value_loss = masked_mean((data.returns - values_pred) ** 2, mask, count)
    entropy_loss = masked_mean(log_prob if entropy is None else -entropy, mask, count)
    loss = policy_loss + cfg.ent_coef * entropy_loss + cfg.vf_coef * value_loss
    with th.no_grad():
        clip_fraction = masked_mean((th.abs(ratio - 1) > cfg.clip_range).float(), mask, count)
        approx_kl = masked_mean((ratio - 1) - log_ratio, mask, count)
        stats = th.stack([policy_loss, clip_fraction, value_loss, entropy_loss, approx_kl, loss]).detach()
    return loss, stats


class FlatOptimizerStep:
    """
    ``zero_grad`` / ``backward`` / ``clip_grad_norm_`` / ``optimizer.step`` with one flat gradient buffer and one
    fused Adam step when the optimizer is a plain ``torch.optim.Adam`` (otherwise the stock calls).

    :param module: the module whose parameters the optimizer holds
    :param optimizer: its optimizer (its ``param_groups`` stay the source of the learning rate)
    """

    def __init__(self, module: nn.Module, optimizer: th.optim.Optimizer) -> None:
        self.module, self.optimizer = module, optimizer
        params = list(module.parameters())
        self.flat: FlatParameters | None = None
        self.adam: FlatAdam | None = None
        if adam_unsupported_reason(optimizer, params) is None:
            self.flat = FlatParameters(params)
            self.adam = FlatAdam(self.flat, optimizer)
            self._attach()

    def _attach(self) -> None:
        assert self.flat is not None
        self.flat.attach_grads()
        self._views = [p.grad for p in self.flat.params]

    def is_bound(self, optimizer: th.optim.Optimizer) -> bool:
        """:return: whether ``optimizer`` is still ours and the parameters and its state still live in our buffers"""
        if optimizer is not self.optimizer:
            return False
        return self.flat is None or (self.flat.is_bound() and self.adam is not None and self.adam.is_bound())

    def step(self, loss: th.Tensor, max_grad_norm: float) -> None:
        """Back-propagate ``loss``, clip the gradient's norm to ``max_grad_norm`` and take one optimizer step."""
        if self.flat is None or self.adam is None:
            self.optimizer.zero_grad()
            loss.backward()
            th.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
            self.optimizer.step()
            return
        self.flat.grad.zero_()
        loss.backward()
        if any(p.grad is not g for p, g in zip(self.flat.params, self._views, strict=True)):
            # the gradients were set to None or replaced (``optimizer.zero_grad()``): take them over and re-attach
            for p in self.flat.params:
                if p.grad is not None:
                    self.flat.grad_of(p).copy_(p.grad)
            self._attach()
        self.adam.step(self.flat.clip_divisor(max_grad_norm))
