"""
SAC's gradient steps with hand-derived gradients, for MLP policies on flat ``Box`` observations (stock ``Actor`` and
``ContinuousCritic``, no gSDE, Adam): the same steps as ``stable_baselines3.SAC.train`` with less arithmetic and
fewer operations:

- the actor runs the observations and the next observations in one forward (the actor does not change between the
  two in stock's step either), and only the first half is back-propagated;
- the critics run as one batched product per layer, the target critics once per step;
- the actor loss back-propagates through the critics to the actions only (stock also computes the critics' weight
  gradients there, and discards them);
- one fused Adam per network over its flat buffer, the polyak update over the whole flat buffer, no host sync
  (the losses are kept as tensors and read once per ``train()``).

What the critics' target, loss and actor value are is a :class:`~sb3_speedups.sac.critic_loss.SoftCriticLoss`: SAC's
(:class:`~sb3_speedups.sac.critic_loss.MinCriticLoss`) by default, TQC's truncated quantiles for TQC.

The maths and the tests that check it: docs/maths.md, "SAC actor" and "Off-policy critics".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch as th
from stable_baselines3.common.logger import Logger
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.mlp import Mlp, parse_mlp
from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.nn.optim import FlatAdam
from sb3_speedups.common.off_policy.actor_net import ActorNet
from sb3_speedups.common.off_policy.critics import (
    actor_and_critic_training_reason,
    SoftUpdate,
    StackedCritics,
    stock_actor_reason,
    parameters_only_in,
    without_weight_gradients,
)
from sb3_speedups.common.off_policy.batches import OffPolicyBatches
from sb3_speedups.common.off_policy.training import mean_of
from sb3_speedups.sac.critic_loss import MinCriticLoss, SoftCriticLoss
from sb3_speedups.sac.squashed_gaussian import sample_squashed, squashed_backward


def sac_unsupported_reason(policy: Any, use_sde: bool, loss: SoftCriticLoss | None = None) -> str | None:
    """
    :param policy: a SAC policy (SB3's ``SACPolicy``) or one built as it (sb3-contrib's ``TQCPolicy``)
    :param loss: the algorithm's critic loss, which names its stock networks (default: SAC's)
    :return: why :class:`HandDerivedSACUpdate` cannot run ``policy``, or ``None`` when it can
    """
    if use_sde:
        return "gSDE"
    loss = loss or MinCriticLoss()
    actor = policy.actor
    reason = stock_actor_reason(actor, loss.actor_class)
    if reason is not None:
        return reason
    hidden = parse_mlp(actor.latent_pi)
    if isinstance(hidden, str) or not hidden.layers:
        return f"actor: {hidden}" if isinstance(hidden, str) else "actor has no hidden layer"
    reason = hidden.trainable_reason()
    if reason is not None:
        return f"actor: {reason}"
    if type(actor.mu) is not th.nn.Linear or type(actor.log_std) is not th.nn.Linear:
        return "actor heads are not Linear layers"
    return actor_and_critic_training_reason(actor, policy.critic, loss.critic_class)


def autograd_ent_coef_step(
    log_ent_coef: th.Tensor, optimizer: th.optim.Optimizer, log_prob: th.Tensor, target_entropy: float
) -> th.Tensor:
    """
    One step of the learned entropy coefficient on stock's loss ``-mean(log_ent_coef * (log_prob + target_entropy))``
    through autograd (SAC's and CrossQ's autograd updates).

    :return: the loss (detached)
    """
    loss = -(log_ent_coef * (log_prob + target_entropy).detach()).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.detach()


class EntCoef:
    """
    SAC's entropy coefficient (TQC's, CrossQ's): the fixed one, or the learned one on a flat buffer, its loss's
    gradient by hand and the fused Adam (building it moves ``log_ent_coef`` into the buffer).

    :param log_ent_coef: the learned log entropy coefficient, or ``None`` when it is fixed
    :param optimizer: its Adam (with ``log_ent_coef``)
    :param fixed: the fixed entropy coefficient (a 0-dim tensor), when not learned
    :param target_entropy: the entropy target of the learned coefficient
    """

    def __init__(
        self,
        log_ent_coef: th.Tensor | None,
        optimizer: th.optim.Optimizer | None,
        fixed: th.Tensor | None,
        target_entropy: float,
    ) -> None:
        self.flat: FlatParameters | None = None
        self.adam: FlatAdam | None = None
        if log_ent_coef is not None and optimizer is not None:
            self.flat = FlatParameters([log_ent_coef])
            self.adam = FlatAdam(self.flat, optimizer)
        self.fixed, self.target_entropy = fixed, target_entropy

    def is_bound(self) -> bool:
        """:return: whether the learned coefficient and its optimizer state still live in the flat buffers"""
        return self.flat is None or (self.flat.is_bound() and self.adam is not None and self.adam.is_bound())

    def value(self, losses: SACStepLosses) -> th.Tensor:
        """:return: the coefficient now (``[1]``; kept in ``losses``)"""
        if self.flat is None:
            assert self.fixed is not None
            losses.ent_coef.append(self.fixed)
            return self.fixed
        ent_coef = th.exp(self.flat.data)
        losses.ent_coef.append(ent_coef)
        return ent_coef

    def step(self, log_prob: th.Tensor, losses: SACStepLosses) -> None:
        """One step of the learned coefficient on stock's loss ``-mean(log_ent_coef * (log_prob + target_entropy))``."""
        if self.flat is None or self.adam is None:
            return
        shifted = log_prob + self.target_entropy
        losses.ent_coef_loss.append(-(self.flat.data * shifted).mean())
        # d/d log_ent_coef of -mean(log_ent_coef * (log_prob + target_entropy))
        th.sum(shifted * (-1.0 / shifted.shape[0]), dim=0, out=self.flat.grad)
        self.adam.step()


@dataclass
class SACStepLosses:
    """Per gradient step values of one ``train()`` call, kept as tensors (read once at its end)."""

    actor: list[th.Tensor]
    critic: list[th.Tensor]
    ent_coef: list[th.Tensor]
    ent_coef_loss: list[th.Tensor]

    def record(self, logger: Logger, n_updates: int, delayed_actor: bool = False) -> None:
        """
        Record what stock's ``train()`` records after its steps (SAC's, TQC's, CrossQ's).

        :param logger: the model's logger
        :param n_updates: the model's update count
        :param delayed_actor: the actor does not step every time (CrossQ's ``policy_delay``): its loss is recorded only
            when it stepped, as stock does
        """
        logger.record("train/n_updates", n_updates, exclude="tensorboard")
        logger.record("train/ent_coef", mean_of(self.ent_coef))
        if self.actor or not delayed_actor:
            logger.record("train/actor_loss", mean_of(self.actor))
        logger.record("train/critic_loss", mean_of(self.critic))
        if self.ent_coef_loss:
            logger.record("train/ent_coef_loss", mean_of(self.ent_coef_loss))


class HandDerivedSACUpdate:
    """
    SAC's gradient step (check :func:`sac_unsupported_reason` first). Building it moves the actor's, the critics' and
    the target critics' parameters (and ``log_ent_coef``) into flat buffers.

    :param policy: the SAC policy (or one built as it: TQC's)
    :param log_ent_coef: the learned log entropy coefficient, or ``None`` when it is fixed
    :param ent_coef_optimizer: its Adam (with ``log_ent_coef``)
    :param ent_coef: the fixed entropy coefficient (a 0-dim tensor), when not learned
    :param target_entropy: the entropy target of the learned coefficient
    :param loss: the critics' target, loss and actor value (default: SAC's)
    """

    def __init__(
        self,
        policy: Any,
        log_ent_coef: th.Tensor | None,
        ent_coef_optimizer: th.optim.Optimizer | None,
        ent_coef: th.Tensor | None,
        target_entropy: float,
        loss: SoftCriticLoss | None = None,
    ) -> None:
        self.loss = loss or MinCriticLoss()
        reason = sac_unsupported_reason(policy, use_sde=False, loss=self.loss)
        if reason is not None:
            raise ValueError(reason)
        self.policy = policy
        actor = policy.actor
        hidden = parse_mlp(actor.latent_pi)
        assert isinstance(hidden, Mlp)
        mu, log_std = cast(th.nn.Linear, actor.mu), cast(th.nn.Linear, actor.log_std)  # checked above
        self.actor = ActorNet(actor, hidden, [mu.weight, log_std.weight], [mu.bias, log_std.bias], actor.optimizer)
        self.critics = StackedCritics(policy.critic, policy.critic_target, policy.critic.optimizer, self.loss.critic_class)
        self.action_dim = mu.out_features
        self.ent = EntCoef(log_ent_coef, ent_coef_optimizer, ent_coef, target_entropy)
        self._noise: dict[int, th.Tensor] = {}

    def is_bound(self) -> bool:
        """:return: whether every parameter and optimizer state still lives in the flat buffers"""
        ent = self.ent.is_bound()
        return self.actor.is_bound() and self.critics.is_bound() and ent

    def _ent_coef(self, log_prob: th.Tensor, losses: SACStepLosses) -> th.Tensor:
        """:return: this step's entropy coefficient (``[1]``), read before stepping the learned one as stock does"""
        ent_coef = self.ent.value(losses)
        self.ent.step(log_prob, losses)
        return ent_coef

    def _noise_buffer(self, n: int, device: th.device) -> th.Tensor:
        noise = self._noise.get(n)
        if noise is None:
            with th.inference_mode(False):
                noise = self._noise[n] = th.empty(n, self.action_dim, device=device)
        return noise

    def step(self, batches: OffPolicyBatches, k: int, update_target: bool, tau: float, losses: SACStepLosses) -> None:
        """
        One gradient step of ``SAC.train`` on minibatch ``k``.

        :param batches: the minibatches of this ``train()`` call
        :param k: which one
        :param update_target: whether the target critics move after this step
        :param tau: the polyak coefficient
        :param losses: where to keep this step's losses
        """
        b, obs_dim = batches.batch_size, self.critics.obs_dim
        actor_in = batches.actor_inputs[k]
        noise = self._noise_buffer(2 * b, actor_in.device)
        # stock draws the noise of the actions for the observations, then of those for the next observations
        noise[:b].normal_()
        noise[b:].normal_()
        sample = sample_squashed(self.actor.forward(actor_in), noise)
        log_prob = sample.log_prob
        ent_coef = self._ent_coef(log_prob[:b], losses)
        next_in = batches.next_critic_inputs[k]
        next_in[:, obs_dim:] = sample.actions[b:]
        next_q = self.loss.target_values(self.critics, next_in) - ent_coef * log_prob[b:]
        target = batches.rewards[k] + batches.discounts[k] * next_q
        losses.critic.append(self.loss.critic_step(self.critics, batches.critic_inputs[k], target))
        pi_in = batches.actor_critic_inputs[k]
        pi_in[:, obs_dim:] = sample.actions[:b]
        value, d_q = self.loss.actor_values(self.critics, pi_in)
        losses.actor.append((ent_coef * log_prob[:b] - value).mean())
        d_actions = self.critics.action_grad(d_q)
        self.actor.step(squashed_backward(sample, b, d_actions, ent_coef / b))
        if update_target:
            self.critics.polyak(tau)


class AutogradSACUpdate:
    """
    SAC's gradient step with autograd, for any policy (gSDE, CNN and ``Dict`` observations, custom networks and
    optimizers): stock's losses, with the flat fused Adam where the optimizer is a plain Adam over its network
    (:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep`; not for the critics when they share the actor's
    features extractor, which stock's critic optimizer leaves out), no critic weight gradients for the actor loss (a
    shared features extractor still gets the actor's), stock's target update in foreach calls
    (:class:`~sb3_speedups.common.off_policy.critics.SoftUpdate`: running statistics copied), and no host sync.

    :param policy: the SAC policy
    :param log_ent_coef: as :class:`HandDerivedSACUpdate`
    :param ent_coef_optimizer: as :class:`HandDerivedSACUpdate`
    :param ent_coef: as :class:`HandDerivedSACUpdate`
    :param target_entropy: as :class:`HandDerivedSACUpdate`
    :param use_sde: resample gSDE's exploration matrix before each step, as stock does
    :param loss: as :class:`HandDerivedSACUpdate`
    """

    def __init__(
        self,
        policy: Any,
        log_ent_coef: th.Tensor | None,
        ent_coef_optimizer: th.optim.Optimizer | None,
        ent_coef: th.Tensor | None,
        target_entropy: float,
        use_sde: bool,
        loss: SoftCriticLoss | None = None,
    ) -> None:
        self.loss = loss or MinCriticLoss()
        self.policy = policy
        self.critic_only = parameters_only_in(policy.critic, policy.actor)
        shares = len(self.critic_only) < len(list(policy.critic.parameters()))
        self.actor_step = FlatOptimizerStep(policy.actor, policy.actor.optimizer)
        self.critic_step = FlatOptimizerStep(policy.critic, policy.critic.optimizer, flat=not shares)
        self.log_ent_coef, self.fixed_ent_coef, self.target_entropy = log_ent_coef, ent_coef, target_entropy
        self.ent_coef_optimizer = ent_coef_optimizer
        self.use_sde = use_sde
        self.soft_update = SoftUpdate.between(policy.critic, policy.critic_target)

    def is_bound(self) -> bool:
        """:return: whether the optimizers are still the policy's and their state lives in the flat buffers"""
        actor, critic = self.policy.actor, self.policy.critic
        return self.actor_step.is_bound(actor.optimizer) and self.critic_step.is_bound(critic.optimizer)

    def _ent_coef(self, log_prob: th.Tensor, losses: SACStepLosses) -> th.Tensor:
        if self.log_ent_coef is None or self.ent_coef_optimizer is None:
            assert self.fixed_ent_coef is not None
            losses.ent_coef.append(self.fixed_ent_coef)
            return self.fixed_ent_coef
        ent_coef = th.exp(self.log_ent_coef.detach())
        losses.ent_coef.append(ent_coef)
        losses.ent_coef_loss.append(
            autograd_ent_coef_step(self.log_ent_coef, self.ent_coef_optimizer, log_prob, self.target_entropy)
        )
        return ent_coef

    def step(self, data: ReplayBufferSamples, gamma: float, update_target: bool, tau: float, losses: SACStepLosses) -> None:
        """
        One gradient step of ``SAC.train`` on one minibatch.

        :param data: the minibatch
        :param gamma: the discount when the minibatch has none (n-step buffers give one per row)
        :param update_target: whether the target critics move after this step
        :param tau: the polyak coefficient
        :param losses: where to keep this step's losses
        """
        actor, critic = self.policy.actor, self.policy.critic
        discounts = data.discounts if data.discounts is not None else gamma
        if self.use_sde:
            actor.reset_noise()
        actions_pi, log_prob = actor.action_log_prob(data.observations)
        log_prob = log_prob.reshape(-1, 1)
        ent_coef = self._ent_coef(log_prob, losses)
        with th.no_grad():
            next_actions, next_log_prob = actor.action_log_prob(data.next_observations)
            next_q = self.loss.autograd_target_values(self.policy.critic_target(data.next_observations, next_actions))
            next_q = next_q - ent_coef * next_log_prob.reshape(-1, 1)
            target = data.rewards + (1 - data.dones) * discounts * next_q
        critic_loss = self.loss.autograd_loss(critic(data.observations, data.actions), target)
        losses.critic.append(critic_loss.detach())
        self.critic_step.backward(critic_loss)
        self.critic_step.step()
        with without_weight_gradients(self.critic_only):
            value = self.loss.autograd_actor_values(critic(data.observations, actions_pi))
            actor_loss = (ent_coef * log_prob - value).mean()
            losses.actor.append(actor_loss.detach())
            self.actor_step.backward(actor_loss)
        self.actor_step.step()
        if update_target:
            self.soft_update(tau)
