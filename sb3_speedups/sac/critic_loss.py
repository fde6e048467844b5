"""
What SAC and the algorithms built on its update (TQC) differ in: the networks' stock classes, the values the critics'
TD target is made of, the critics' loss and the value the actor loss maximises. :class:`SoftCriticLoss` is that
strategy, with a hand-derived side (on :class:`~sb3_speedups.common.off_policy.critics.StackedCritics`) and an autograd
side (on the critic modules' outputs); SAC's is :class:`MinCriticLoss`, TQC's
:class:`~sb3_speedups.tqc.quantile_loss.TruncatedQuantileLoss`. The rest of the step (the squashed Gaussian actor, the
entropy coefficient, the polyak update) is SAC's for all of them (:mod:`sb3_speedups.sac.update`).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch as th
import torch.nn.functional as F
from stable_baselines3.common.policies import BaseModel, BasePolicy, ContinuousCritic
from stable_baselines3.sac.policies import Actor

from sb3_speedups.common.off_policy.critics import StackedCritics


class SoftCriticLoss(Protocol):
    """A SAC-family algorithm's critics: their stock classes, TD target values, loss and the actor's value."""

    #: the stock actor class the hand-derived update runs (a squashed Gaussian: ``latent_pi``, ``mu``, ``log_std``)
    actor_class: type[BasePolicy]
    #: the stock critic class (``n_critics`` MLPs on ``[features, actions]``)
    critic_class: type[BaseModel]

    def target_values(self, critics: StackedCritics, x: th.Tensor) -> th.Tensor:
        """:return: the target critics' values of ``x = [next_obs, next_actions]`` that make the TD targets ``[n, k]``"""
        ...

    def critic_step(self, critics: StackedCritics, x: th.Tensor, target: th.Tensor) -> th.Tensor:
        """One Adam step of the critics on their loss for inputs ``x`` and TD targets ``[n, k]``; :return: the loss (0-dim)"""
        ...

    def actor_values(self, critics: StackedCritics, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """
        :return: the critics' value ``[n, 1]`` of ``x = [obs, actor's actions]`` that the actor loss maximises, and the
            gradient of ``-mean(value)`` with respect to that :meth:`StackedCritics.q_values` call ``[G, n, width]``
        """
        ...

    def autograd_target_values(self, next_q: Any) -> th.Tensor:
        """:return: :meth:`target_values` from the target critic module's output"""
        ...

    def autograd_loss(self, current_q: Any, target: th.Tensor) -> th.Tensor:
        """:return: the critics' loss (stock's) from the critic module's output and the TD targets"""
        ...

    def autograd_actor_values(self, q: Any) -> th.Tensor:
        """:return: :meth:`actor_values`' value from the critic module's output"""
        ...


class MinCriticLoss:
    """SAC's: the smallest of the ``n_critics`` values (target and actor), each critic's mean squared error, halved."""

    actor_class: type[BasePolicy] = Actor
    critic_class: type[BaseModel] = ContinuousCritic

    def target_values(self, critics: StackedCritics, x: th.Tensor) -> th.Tensor:
        return critics.target_min(x)

    def critic_step(self, critics: StackedCritics, x: th.Tensor, target: th.Tensor) -> th.Tensor:
        return critics.step(x, target, 0.5)

    def actor_values(self, critics: StackedCritics, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        b = x.shape[0]
        min_q, argmin = th.min(critics.q_values(x), dim=0)
        d_q = th.zeros(critics.groups, b, 1, device=min_q.device).scatter_(0, argmin.unsqueeze(0), -1.0 / b)
        return min_q, d_q

    def autograd_target_values(self, next_q: Any) -> th.Tensor:
        return th.min(th.cat(next_q, dim=1), dim=1, keepdim=True).values

    def autograd_loss(self, current_q: Any, target: th.Tensor) -> th.Tensor:
        loss = 0.5 * sum(F.mse_loss(q, target) for q in current_q)
        assert isinstance(loss, th.Tensor)
        return loss

    def autograd_actor_values(self, q: Any) -> th.Tensor:
        return th.min(th.cat(q, dim=1), dim=1, keepdim=True).values
