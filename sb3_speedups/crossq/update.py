"""
CrossQ's gradient step (``sb3_contrib.CrossQ.train``'s loop body) for MLP policies on flat ``Box`` observations.

For the default networks (``Linear`` layers with ``BatchRenorm1d`` layers before them and ReLU or Tanh activations)
every gradient is by hand, as in SAC's step: the critics are :class:`~sb3_speedups.crossq.critics.RenormCritics` (the
joint training-mode forward of ``(s, a)`` and ``(s', a')`` as one batched product per layer of the stacked critics,
the batch-renormalisation layers as input norms), the actor an
:class:`~sb3_speedups.common.off_policy.actor_net.ActorNet` with the same norms, the actor loss back-propagated
through the critics in evaluation mode to the actions only; one flat fused Adam per network; no ``steps`` read per
forward, no ``set_bn_training_mode`` walks; no host sync (the losses are kept as tensors and read once per
``train()``).

Other MLPs (layers or activations the hand path does not take) run stock's losses through autograd with the
training-mode ``BatchRenorm1d`` layers as one autograd node each with a hand-derived backward
(:class:`~sb3_speedups.crossq.batch_renorm.BatchRenormTraining`) and the flat fused Adam
(:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep`). Everything else (non-``Box`` observations, gSDE, custom
networks) runs stock's ``train()`` (:class:`StockCrossQUpdate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch as th
from gymnasium import spaces
from sb3_contrib.common.torch_layers import BatchRenorm1d
from sb3_contrib.crossq.policies import Actor, CrossQCritic
from stable_baselines3.common.torch_layers import FlattenExtractor
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from torch import nn

from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.off_policy.critics import parameters_only_in, without_weight_gradients
from sb3_speedups.crossq.batch_renorm import RenormCounts, run_sequential
from sb3_speedups.crossq.critics import (
    RenormCritics,
    count_norms,
    renorm_actor_net,
    renorm_actor_reason,
    renorm_critics_reason,
    use_norms,
)
from sb3_speedups.sac.critic_loss import MinCriticLoss
from sb3_speedups.sac.squashed_gaussian import SquashedSample, sample_squashed, squashed_backward
from sb3_speedups.sac.update import EntCoef, SACStepLosses, autograd_ent_coef_step


def _layers_reason(net: nn.Module, name: str) -> str | None:
    if type(net) is not nn.Sequential:
        return f"{name} is not an nn.Sequential"
    for layer in net:
        if type(layer) in (nn.Linear, BatchRenorm1d):
            continue
        if any(True for _ in layer.parameters()) or list(layer.buffers()):
            return f"{name} has a {type(layer).__name__} layer"
    return None


def crossq_unsupported_reason(policy: Any, use_sde: bool) -> str | None:
    """:return: why :class:`CrossQUpdate` cannot run ``policy`` (so stock's ``train()`` does), or ``None``"""
    if use_sde:
        return "gSDE"
    actor, critic = policy.actor, policy.critic
    if type(actor) is not Actor or type(critic) is not CrossQCritic:
        return "custom actor or critic"
    if not isinstance(policy.observation_space, spaces.Box):
        return f"{type(policy.observation_space).__name__} observations"
    for net in (actor, critic):
        if type(net.features_extractor) is not FlattenExtractor:
            return f"features extractor {type(net.features_extractor).__name__}"
    if type(actor.mu) is not nn.Linear or type(actor.log_std) is not nn.Linear:
        return "actor heads are not Linear layers"
    nets = [(actor.latent_pi, "actor"), *((q, f"critic {i}") for i, q in enumerate(critic.q_networks))]
    for net, name in nets:
        reason = _layers_reason(net, name)
        if reason is not None:
            return reason
    return None


@dataclass
class StockCrossQUpdate:
    """The fallback: sb3-contrib's own ``train()`` runs (the models :func:`crossq_unsupported_reason` refuses)."""

    policy: Any

    def is_bound(self) -> bool:
        """:return: always (stock's ``train()`` takes the policy's optimizers as they are)"""
        return True


class CrossQUpdate:
    """
    CrossQ's gradient step (check :func:`crossq_unsupported_reason` first). Building it moves the actor's and the
    critics' parameters into flat buffers.

    :param policy: the CrossQ policy
    :param log_ent_coef: as :class:`~sb3_speedups.sac.update.EntCoef`'s
    :param ent_coef_optimizer: as :class:`~sb3_speedups.sac.update.EntCoef`'s ``optimizer``
    :param ent_coef: as :class:`~sb3_speedups.sac.update.EntCoef`'s ``fixed``
    :param target_entropy: as :class:`~sb3_speedups.sac.update.EntCoef`'s
    """

    def __init__(
        self,
        policy: Any,
        log_ent_coef: th.Tensor | None,
        ent_coef_optimizer: th.optim.Optimizer | None,
        ent_coef: th.Tensor | None,
        target_entropy: float,
    ) -> None:
        self.policy = policy
        # the critics' step by hand where their layers allow (renorm_critics_reason), else through autograd; the
        # actor's by hand where the critics' is and its layers allow
        hand = renorm_critics_reason(policy.critic, policy.critic.optimizer) is None
        self.critics = RenormCritics(policy.critic, policy.critic.optimizer) if hand else None
        self.critic_step = None if hand else FlatOptimizerStep(policy.critic, policy.critic.optimizer)
        hand_actor = hand and renorm_actor_reason(policy.actor) is None
        self.actor_net = renorm_actor_net(policy.actor) if hand_actor else None
        self.actor_step = None if hand_actor else FlatOptimizerStep(policy.actor, policy.actor.optimizer)
        # the hand path's entropy coefficient is SAC's (the learned one on a flat buffer, its gradient by hand)
        self.ent = EntCoef(log_ent_coef, ent_coef_optimizer, ent_coef, target_entropy) if hand_actor else None
        self.critic_only = parameters_only_in(policy.critic, policy.actor)
        self._renorm_layers = RenormCounts(policy.actor, policy.critic).layers
        self.log_ent_coef, self.ent_coef_optimizer = log_ent_coef, ent_coef_optimizer
        self.fixed_ent_coef, self.target_entropy = ent_coef, target_entropy
        self.loss = MinCriticLoss()

    @property
    def by_hand(self) -> bool:
        """Whether every gradient of the step is hand-derived (the critics', the actor's and the coefficient's)."""
        return self.critics is not None and self.actor_net is not None

    def is_bound(self) -> bool:
        """:return: whether the optimizers are still the policy's and their state lives in the flat buffers"""
        actor, critic = self.policy.actor, self.policy.critic
        if self.critics is not None:
            critics_bound = self.critics.adam.optimizer is critic.optimizer and self.critics.is_bound()
        else:
            critics_bound = self.critic_step is not None and self.critic_step.is_bound(critic.optimizer)
        if self.actor_net is not None:
            adam = self.actor_net.adam
            bound = adam is not None and adam.optimizer is actor.optimizer and self.actor_net.is_bound()
            return bound and self.ent is not None and self.ent.is_bound() and critics_bound
        return self.actor_step is not None and self.actor_step.is_bound(actor.optimizer) and critics_bound

    def counts(self) -> RenormCounts:
        """:return: the batch-renormalisation layers' step counts, read now (once per ``train()``)"""
        counts = RenormCounts(layers=self._renorm_layers)
        if self.critics is not None:
            self.critics.begin(counts)
        if self.actor_net is not None:
            count_norms(self.actor_net.chain.norms or [], counts)
        return counts

    def _actor(self, obs: th.Tensor, training: bool, counts: RenormCounts) -> tuple[th.Tensor, th.Tensor]:
        """:return: ``actor.action_log_prob(obs)`` with the layers in training (``training``) or evaluation mode"""
        actor = self.policy.actor
        latent = run_sequential(actor.latent_pi, actor.extract_features(obs, actor.features_extractor), training, counts)
        mean = actor.mu(latent)
        # stock's operations and draw (``Normal.rsample``), without building and validating a distribution per call
        sample = sample_squashed(th.cat([mean, actor.log_std(latent)], dim=1), th.empty_like(mean).normal_())
        return sample.actions, sample.log_prob.reshape(-1)

    def _critics(self, obs: th.Tensor, actions: th.Tensor, training: bool, counts: RenormCounts) -> list[th.Tensor]:
        """:return: ``critic(obs, actions)`` with the layers in training (``training``) or evaluation mode"""
        critic = self.policy.critic
        with th.no_grad():  # a flattened Box: nothing to train in the features
            features = critic.extract_features(obs, critic.features_extractor)
        x = th.cat([features, actions], dim=1)
        return [run_sequential(q, x, training, counts) for q in critic.q_networks]

    def step(
        self, data: ReplayBufferSamples, gamma: float, update_actor: bool, counts: RenormCounts, losses: SACStepLosses
    ) -> None:
        """
        One gradient step of ``CrossQ.train`` on one minibatch.

        :param data: the minibatch
        :param gamma: the discount when the minibatch has none (n-step buffers give one per row)
        :param update_actor: a delayed policy update follows the critics' step (``_n_updates % policy_delay == 0``)
        :param counts: the layers' step counts of this ``train()`` call
        :param losses: where to keep this step's losses
        """
        b = data.observations.shape[0]
        discounts = data.discounts if data.discounts is not None else gamma
        if self.ent is not None:
            ent_coef = self.ent.value(losses)
        else:
            fixed = th.exp(self.log_ent_coef.detach()) if self.log_ent_coef is not None else self.fixed_ent_coef
            assert fixed is not None
            losses.ent_coef.append(fixed)
            ent_coef = fixed
        with th.no_grad():
            if self.actor_net is not None:
                next_actions, next_log_prob = self._hand_actor(data.next_observations, False)
            else:
                next_actions, next_log_prob = self._actor(data.next_observations, False, counts)
        # the joint forward: the batch statistics are those of the mixture of (s, a) and (s', a')
        obs = th.cat([data.observations, data.next_observations])
        actions = th.cat([data.actions, next_actions])
        if self.critics is not None:
            critic = self.policy.critic
            with th.no_grad():  # a flattened Box: nothing to train in the features
                features = critic.extract_features(obs, critic.features_extractor)
            q = self.critics.q_values(th.cat([features, actions], dim=1))
            next_q = th.amin(q[:, b:], dim=0) - ent_coef * next_log_prob.reshape(-1, 1)
            target = data.rewards + (1 - data.dones) * discounts * next_q
            losses.critic.append(self.critics.joint_step(q, target))
        else:
            assert self.critic_step is not None
            all_q = self._critics(obs, actions, True, counts)
            with th.no_grad():
                next_q = self.loss.autograd_target_values([q[b:] for q in all_q])
                target = data.rewards + (1 - data.dones) * discounts * (next_q - ent_coef * next_log_prob.reshape(-1, 1))
            critic_loss = self.loss.autograd_loss([q[:b] for q in all_q], target)
            losses.critic.append(critic_loss.detach())
            self.critic_step.backward(critic_loss)
            self.critic_step.step()
        if not update_actor:
            return
        if self.actor_net is not None:
            self._hand_actor_step(data.observations, ent_coef, losses)
            return
        assert self.actor_step is not None
        actions_pi, log_prob = self._actor(data.observations, True, counts)
        log_prob = log_prob.reshape(-1, 1)
        self._ent_coef_step(log_prob, losses)
        with without_weight_gradients(self.critic_only):
            value = self.loss.autograd_actor_values(self._critics(data.observations, actions_pi, False, counts))
            actor_loss = (ent_coef * log_prob - value).mean()
            losses.actor.append(actor_loss.detach())
            self.actor_step.backward(actor_loss)
        self.actor_step.step()

    def _ent_coef_step(self, log_prob: th.Tensor, losses: SACStepLosses) -> None:
        if self.log_ent_coef is not None and self.ent_coef_optimizer is not None:
            losses.ent_coef_loss.append(
                autograd_ent_coef_step(self.log_ent_coef, self.ent_coef_optimizer, log_prob, self.target_entropy)
            )

    def _hand_sample(self, obs: th.Tensor, training: bool) -> SquashedSample:
        """:return: the actor's sample for ``obs`` (stock's draw) through :attr:`actor_net`, its layers in that mode"""
        assert self.actor_net is not None
        actor = self.policy.actor
        norms = self.actor_net.chain.norms or []
        use_norms(norms, training)
        with th.no_grad():  # a flattened Box: nothing to train in the features
            out = self.actor_net.forward(actor.extract_features(obs, actor.features_extractor))
        use_norms(norms, True)
        k = out.shape[1] // 2
        return sample_squashed(out, th.empty(obs.shape[0], k, device=out.device).normal_())

    def _hand_actor(self, obs: th.Tensor, training: bool) -> tuple[th.Tensor, th.Tensor]:
        """:return: :meth:`_actor`'s values through :attr:`actor_net`"""
        sample = self._hand_sample(obs, training)
        return sample.actions, sample.log_prob.reshape(-1)

    def _hand_actor_step(self, obs: th.Tensor, ent_coef: th.Tensor, losses: SACStepLosses) -> None:
        """The delayed actor step with hand-derived gradients (the layers in training mode, the critics' in evaluation)."""
        assert self.actor_net is not None and self.critics is not None
        critic = self.policy.critic
        b = obs.shape[0]
        sample = self._hand_sample(obs, True)
        with th.no_grad():
            features = critic.extract_features(obs, critic.features_extractor)
        log_prob = sample.log_prob
        assert self.ent is not None
        self.ent.step(log_prob, losses)
        self.critics.use(False)
        value, d_q = self.loss.actor_values(self.critics, th.cat([features, sample.actions], dim=1))
        losses.actor.append((ent_coef * log_prob - value).mean())
        d_actions = self.critics.action_grad(d_q)
        self.critics.use(True)
        self.actor_net.step(squashed_backward(sample, b, d_actions, ent_coef / b))
