"""
TQC's critics (sb3-contrib's ``Critic``: ``n_critics`` MLPs of ``n_quantiles`` outputs) as a
:class:`~sb3_speedups.sac.critic_loss.SoftCriticLoss` of SAC's update: the truncated mixture of the target critics'
quantiles, the quantile Huber loss with its gradient derived by hand, and the mean of all quantiles for the actor. The
maths: docs/maths.md, "TQC quantile Huber loss" (the loss and its gradient: :mod:`sb3_speedups.common.nn.quantile_huber`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch as th
from sb3_contrib.common.utils import quantile_huber_loss
from sb3_contrib.tqc.policies import Actor, Critic
from stable_baselines3.common.policies import BaseModel, BasePolicy

from sb3_speedups.common.nn.quantile_huber import QuantileHuberLoss
from sb3_speedups.common.off_policy.critics import StackedCritics


class TruncatedQuantileLoss:
    """
    TQC's critics: the TD targets are the target critics' quantiles of all critics, sorted, the largest
    ``top_quantiles_to_drop_per_net * n_critics`` dropped; the loss is sb3-contrib's ``quantile_huber_loss`` (mean
    over rows, critics, quantiles and targets: ``sum_over_quantiles=False``); the actor maximises the mean of all
    quantiles.

    :param n_critics: the critics
    :param n_quantiles: the quantiles of each
    :param top_quantiles_to_drop_per_net: TQC's truncation
    """

    actor_class: type[BasePolicy] = Actor
    critic_class: type[BaseModel] = Critic

    def __init__(self, n_critics: int, n_quantiles: int, top_quantiles_to_drop_per_net: int) -> None:
        self.n_critics, self.n_quantiles = n_critics, n_quantiles
        self.n_target_quantiles = (n_quantiles - top_quantiles_to_drop_per_net) * n_critics
        self.huber = QuantileHuberLoss(n_quantiles)
        self._d_mean: dict[int, th.Tensor] = {}

    def target_values(self, critics: StackedCritics, x: th.Tensor) -> th.Tensor:
        """:return: the ``n_target_quantiles`` smallest target quantiles of each row, ascending ``[n, n_target_quantiles]``"""
        q = critics.target_q_values(x)  # [G, n, Q]
        mixture = q.transpose(0, 1).reshape(x.shape[0], -1)
        if mixture.device.type == "cpu":  # numpy's sort of these short rows is several times faster (same values)
            return th.from_numpy(np.sort(mixture.numpy(), axis=1)[:, : self.n_target_quantiles])
        return th.sort(mixture, dim=1).values[:, : self.n_target_quantiles]

    def critic_step(self, critics: StackedCritics, x: th.Tensor, target: th.Tensor) -> th.Tensor:
        """
        One Adam step on sb3-contrib's quantile Huber loss (``sum_over_quantiles=False``) of the critics' quantiles
        ``[G, n, Q]`` against the targets ``[n, T]`` (each row's targets for every critic and quantile).
        """
        q = critics.q_values(x)
        grad, loss = self.huber(q, target, sum_over_quantiles=False, out=q)  # q's own buffer: its values are used up
        critics.backward_step(grad)
        return loss

    def actor_values(self, critics: StackedCritics, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """:return: the mean of every critic's quantiles ``[n, 1]`` and the gradient of ``-mean`` (a constant)"""
        n = x.shape[0]
        value = critics.q_values(x).mean(dim=2).mean(dim=0).unsqueeze(1)
        d_mean = self._d_mean.get(n)
        if d_mean is None:
            with th.inference_mode(False):
                shape = (self.n_critics, n, self.n_quantiles)
                d_mean = self._d_mean[n] = th.full(shape, -1.0 / (n * self.n_critics * self.n_quantiles), device=x.device)
        return value, d_mean

    def autograd_target_values(self, next_q: Any) -> th.Tensor:
        sorted_quantiles, _ = th.sort(next_q.reshape(next_q.shape[0], -1))
        return sorted_quantiles[:, : self.n_target_quantiles]

    def autograd_loss(self, current_q: Any, target: th.Tensor) -> th.Tensor:
        return quantile_huber_loss(current_q, target.unsqueeze(1), sum_over_quantiles=False)

    def autograd_actor_values(self, q: Any) -> th.Tensor:
        return q.mean(dim=2).mean(dim=1, keepdim=True)
