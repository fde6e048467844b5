"""
QR-DQN's part of the Q-learning update (:class:`QuantileHead`): the network outputs ``n_quantiles`` quantiles of the
return per action, the TD target is a vector of quantiles, and the loss is sb3-contrib's quantile Huber loss, with its
gradient derived by hand (:mod:`sb3_speedups.common.nn.quantile_huber`, shared with TQC) for
:class:`~sb3_speedups.dqn.update.HandDerivedQUpdate`. The maths: docs/maths.md, "QR-DQN quantile Huber loss".
"""

from __future__ import annotations

from typing import Any

import torch as th
from sb3_contrib.common.utils import quantile_huber_loss
from sb3_contrib.qrdqn.policies import QuantileNetwork
from stable_baselines3.common.policies import BasePolicy
from torch import nn

from sb3_speedups.common.nn.quantile_huber import QuantileHuberLoss
from sb3_speedups.dqn.update import QHead


class QuantileHead(QHead):
    """
    Quantiles ``[n, n_quantiles, n_actions]`` (the layout of ``QuantileNetwork.forward``'s view of its last layer), the
    quantile Huber loss summed over the current quantiles (``sum_over_quantiles=True``, sb3-contrib's ``QRDQN``).
    A step's result is its loss (a 0-dim tensor, read once per ``train()``).

    :param n_quantiles: quantiles per action
    :param n_actions: actions
    """

    network_class = QuantileNetwork

    def __init__(self, n_quantiles: int, n_actions: int) -> None:
        self.n_quantiles, self.n_actions = n_quantiles, n_actions
        self.huber = QuantileHuberLoss(n_quantiles)
        # by row count: the chosen quantiles [n, n_quantiles, 1] and the output's gradient [n, n_quantiles, n_actions],
        # with their views, kept (a step then allocates neither)
        self._kept: dict[tuple[int, th.device], tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor]] = {}

    @th.inference_mode(False)  # normal tensors, usable in any mode
    def _buffers(self, out: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor, th.Tensor]:
        n = out.shape[0]
        chosen = th.empty(n, self.n_quantiles, 1, device=out.device)
        d_out = th.zeros(n, self.n_quantiles, self.n_actions, device=out.device)
        kept = self._kept[(n, out.device)] = (chosen, chosen.squeeze(2), d_out, d_out.view(n, -1))
        return kept

    def network(self, policy: BasePolicy) -> BasePolicy:
        return policy.quantile_net  # type: ignore[return-value]

    def target_network(self, policy: BasePolicy) -> BasePolicy:
        return policy.quantile_net_target  # type: ignore[return-value]

    def body(self, network: BasePolicy) -> nn.Module:
        return network.quantile_net  # type: ignore[return-value]

    def _quantiles(self, out: th.Tensor) -> th.Tensor:
        return out.view(-1, self.n_quantiles, self.n_actions)

    def q_values(self, out: th.Tensor) -> th.Tensor:
        return self._quantiles(out).mean(dim=1)

    def next_values(self, out: th.Tensor, actions: th.Tensor | None) -> th.Tensor:
        """:return: the quantiles ``[n, n_quantiles]`` of the greedy action by their mean (or of ``actions``)"""
        quantiles = self._quantiles(out)
        chosen = quantiles.mean(dim=1, keepdim=True).argmax(dim=2, keepdim=True) if actions is None else actions.view(-1, 1, 1)
        return quantiles.gather(2, chosen.expand(quantiles.shape[0], self.n_quantiles, 1)).squeeze(2)

    def _index(self, actions: th.Tensor) -> th.Tensor:
        """:return: the stored actions as the index of their quantiles ``[b, n_quantiles, 1]``"""
        index = actions if actions.dtype == th.int64 else actions.long()
        return index.view(-1, 1, 1).expand(index.shape[0], self.n_quantiles, 1)

    def output_grad(
        self, out: th.Tensor, actions: th.Tensor, target: th.Tensor, weights: th.Tensor | None
    ) -> tuple[th.Tensor, th.Tensor]:
        if weights is not None:
            raise ValueError("QR-DQN's loss takes no importance-sampling weights")
        chosen, current, d_out, d_out_rows = self._kept.get((out.shape[0], out.device)) or self._buffers(out)
        index = self._index(actions)
        th.gather(self._quantiles(out), 2, index, out=chosen)
        _, loss = self.huber(current, target, sum_over_quantiles=True, out=current)  # the gradient, in chosen's buffer
        d_out.zero_().scatter_(2, index, chosen)
        return d_out_rows, loss

    def autograd_loss(
        self, out: th.Tensor, actions: th.Tensor, target: th.Tensor, weights: th.Tensor | None
    ) -> tuple[th.Tensor, th.Tensor]:
        if weights is not None:
            raise ValueError("QR-DQN's loss takes no importance-sampling weights")
        current = th.gather(self._quantiles(out), dim=2, index=self._index(actions)).squeeze(dim=2)
        loss = quantile_huber_loss(current, target, sum_over_quantiles=True)
        return loss, loss.detach()

    def logged_loss(self, results: list[Any], weights: list[th.Tensor] | None) -> th.Tensor:
        return th.stack(results).mean()  # stock logs the mean of the per-step losses
