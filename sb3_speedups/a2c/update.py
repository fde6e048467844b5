"""
A2C's one gradient step per rollout, on the whole rollout, two ways with one interface (``update`` -> the loss's
statistics as a tensor :data:`A2C_STATS`, no host sync):

- :class:`HandDerivedA2CUpdate`: MLP policies with a standard head, the loss's gradient written by hand (see
  docs/maths.md, "A2C loss"), through the head's and :class:`~sb3_speedups.common.nn.training.ActorCriticMlp`'s
  backward into one flat gradient buffer, then one flat RMSprop or Adam step (:mod:`sb3_speedups.common.nn.optim`);
- :class:`AutogradA2CUpdate`: any ``ActorCriticPolicy`` (gSDE, CNNs, dict observations, custom optimizers) through
  SB3's ``evaluate_actions`` and autograd, with the flat optimizer step where the optimizer allows it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.type_aliases import DictRolloutBufferSamples, RolloutBufferSamples

from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.nn.optim import make_flat_optimizer
from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp
from sb3_speedups.common.torch_utils import KeptScalar, to_channels_last, trains_channels_last

#: the statistics of one update, in the order of its stats tensor (what stock A2C logs)
A2C_STATS = ("policy_loss", "value_loss", "entropy_loss")
POLICY_LOSS, VALUE_LOSS, ENTROPY_LOSS = range(len(A2C_STATS))


@dataclass
class A2CLossConfig:
    """The loss's coefficients for one ``train()`` call."""

    ent_coef: float
    vf_coef: float
    max_grad_norm: float
    normalize_advantage: bool


def normalized_advantages(advantages: th.Tensor) -> th.Tensor:
    """:return: the advantages normalised over the whole rollout, as stock A2C does (unbiased std)"""
    return (advantages - advantages.mean()) / (advantages.std() + 1e-8)


def a2c_loss(
    log_prob: th.Tensor,
    entropy: th.Tensor | None,
    values: th.Tensor,
    advantages: th.Tensor,
    returns: th.Tensor,
    cfg: A2CLossConfig,
) -> tuple[th.Tensor, th.Tensor]:
    """
    Stock A2C's loss, through autograd.

    :return: the loss and its statistics (:data:`A2C_STATS`), detached
    """
    if cfg.normalize_advantage:
        advantages = normalized_advantages(advantages)
    policy_loss = -(advantages * log_prob).mean()
    value_loss = F.mse_loss(returns, values)
    entropy_loss = -th.mean(-log_prob) if entropy is None else -th.mean(entropy)
    loss = policy_loss + cfg.ent_coef * entropy_loss + cfg.vf_coef * value_loss
    return loss, th.stack([policy_loss, value_loss, entropy_loss]).detach()


@dataclass
class A2CWorkspace:
    """The per-sample buffers of :class:`HandDerivedA2CUpdate` for one rollout size, allocated once."""

    n: int
    #: ``[len(A2C_STATS), n]``: the per-sample terms whose means make the statistics
    rows: th.Tensor
    stat_rows: list[th.Tensor]
    #: +1/-1 per row: the policy-loss row holds ``A * log pi``, whose mean the loss negates
    signs: th.Tensor
    mean_weights: th.Tensor
    stats: th.Tensor
    log_prob: th.Tensor
    err: th.Tensor
    g_log_prob: th.Tensor
    #: ``[n, 1]`` d loss / d V, and its flat view
    g_values: th.Tensor
    g_values_flat: th.Tensor
    #: ``-1 / n`` and ``2 vf_coef / n`` as kept 0-dim tensors
    neg_inv_n: th.Tensor
    value_scale: KeptScalar
    head: Any

    @classmethod
    @th.inference_mode(False)
    def allocate(cls, n: int, device: th.device, head: ActionHead) -> A2CWorkspace:
        """Normal tensors even when allocated under inference mode (train() runs there)."""
        rows = th.zeros(len(A2C_STATS), n, device=device)
        g_values = th.empty(n, 1, device=device)
        signs = th.ones(len(A2C_STATS), device=device)
        signs[POLICY_LOSS] = -1.0  # the row holds A * log pi; the policy loss is minus its mean

        def vector() -> th.Tensor:
            return th.empty(n, device=device)

        return cls(
            n=n,
            rows=rows,
            stat_rows=list(rows),
            signs=signs,
            mean_weights=th.full((n,), 1.0 / n, device=device),
            stats=th.empty(len(A2C_STATS), device=device),
            log_prob=vector(),
            err=vector(),
            g_log_prob=vector(),
            g_values=g_values,
            g_values_flat=g_values.view(-1),
            neg_inv_n=KeptScalar(device)(-1.0 / n),
            value_scale=KeptScalar(device),
            head=head.workspace(n, device),
        )


class HandDerivedA2CUpdate:
    """
    Hand-derived A2C update of an MLP ``ActorCriticPolicy``; building it moves the policy's parameters into one flat
    buffer and its optimizer's state into :class:`~sb3_speedups.common.nn.optim.FlatRMSprop` or ``FlatAdam``.

    :param policy: a policy accepted by :func:`~sb3_speedups.common.on_policy.fast_paths.mlp_model_unsupported_reason`
        with an optimizer accepted by :func:`~sb3_speedups.common.nn.optim.flat_optimizer_unsupported_reason`
    :param head: the policy's action head
    """

    def __init__(self, policy: ActorCriticPolicy, head: ActionHead) -> None:
        self.policy, self.head = policy, head
        self.net = ActorCriticMlp(policy)
        self.flat = self.net.flat
        self.optimizer = make_flat_optimizer(self.flat, policy.optimizer)
        self._ws: dict[int, A2CWorkspace] = {}

    def is_bound(self) -> bool:
        """:return: whether the policy's parameters and optimizer state still live in our flat buffers"""
        return self.policy.optimizer is self.optimizer.optimizer and self.flat.is_bound() and self.optimizer.is_bound()

    def update(
        self,
        observations: th.Tensor | dict[str, th.Tensor],
        actions: th.Tensor,
        advantages: th.Tensor,
        returns: th.Tensor,
        cfg: A2CLossConfig,
    ) -> th.Tensor:
        """
        One gradient step on the whole rollout.

        :param observations: observations ``[n, ...]``; pass the network's input itself (float32 rows ``[n, obs_dim]``,
            or int64 one-hot columns), the same tensor every update, to spare the conversion and the input's views;
            ``Dict`` observations as their entries
        :param actions: the stored float actions ``[n, action_dim]``
        :param advantages: ``[n]``
        :param returns: ``[n]``
        :param cfg: coefficients
        :return: the statistics (:data:`A2C_STATS`), a tensor kept until the next update
        """
        n = actions.shape[0]
        ws = self._ws.get(n) or self._ws.setdefault(n, A2CWorkspace.allocate(n, actions.device, self.head))
        rows = ws.stat_rows
        out, values = self.net.forward(self.net.inputs(observations))
        self.head.forward(ws.head, out, self.head.training_actions(actions), self.net.log_std, ws.log_prob, rows[ENTROPY_LOSS])
        if cfg.normalize_advantage:
            advantages = normalized_advantages(advantages)
        th.mul(advantages, ws.log_prob, out=rows[POLICY_LOSS])
        th.sub(values, returns, out=ws.err)
        th.mul(ws.err, ws.err, out=rows[VALUE_LOSS])
        th.mv(ws.rows, ws.mean_weights, out=ws.stats).mul_(ws.signs)
        # d L / d log pi = -A / n, d L / d H = -ent_coef / n, d L / d V = 2 vf_coef (V - R) / n
        th.mul(advantages, ws.neg_inv_n, out=ws.g_log_prob)
        th.mul(ws.err, ws.value_scale(2.0 * cfg.vf_coef / n), out=ws.g_values_flat)
        d_out = self.net.d_out_buffer(n)
        self.head.backward(ws.head, ws.g_log_prob, -cfg.ent_coef / n, d_out, self.net.grad_log_std)
        self.net.backward(d_out, ws.g_values)
        self.optimizer.step(self.flat.clip_divisor(cfg.max_grad_norm))
        return ws.stats


class AutogradA2CUpdate:
    """
    A2C update through autograd for any ``ActorCriticPolicy``, as stock computes it, with one flat gradient buffer,
    one norm and one flat RMSprop/Adam step where the optimizer is a plain one
    (:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep`).

    :param policy: the policy
    """

    def __init__(self, policy: ActorCriticPolicy) -> None:
        self.policy = policy
        self.step = FlatOptimizerStep(policy, policy.optimizer, rmsprop=True)
        self._discrete = isinstance(policy.action_space, spaces.Discrete)
        self._channels_last = trains_channels_last(policy, policy.device)

    def is_bound(self) -> bool:
        """:return: whether the policy's parameters, gradients and optimizer state are still ours"""
        return self.step.is_bound(self.policy.optimizer)

    def update(self, data: RolloutBufferSamples | DictRolloutBufferSamples, cfg: A2CLossConfig) -> th.Tensor:
        """
        One gradient step on the whole rollout ``data`` (the one batch of the buffer's ``get()``).

        :return: the statistics (:data:`A2C_STATS`)
        """
        actions = data.actions.long().flatten() if self._discrete else data.actions
        obs = to_channels_last(data.observations) if self._channels_last else data.observations
        values, log_prob, entropy = self.policy.evaluate_actions(obs, actions)  # type: ignore[arg-type]
        loss, stats = a2c_loss(log_prob, entropy, values.flatten(), data.advantages, data.returns, cfg)
        self.step.backward(loss)
        self.step.step(cfg.max_grad_norm)
        return stats
