"""
TD3's (and DDPG's) gradient steps with hand-derived gradients, for MLP policies on flat ``Box`` observations (stock
``Actor`` and ``ContinuousCritic``, Adam): the same steps as ``stable_baselines3.TD3.train``, with the critics as one
batched product per layer, the actor loss back-propagated through the first critic to the actions only (no critic
weight gradients), one fused Adam per network and the polyak updates over whole flat buffers. The maths and the tests
that check it: docs/maths.md, "TD3 actor" and "Off-policy critics".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch as th
import torch.nn.functional as F
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from stable_baselines3.td3.policies import Actor, TD3Policy

from sb3_speedups.common.nn.mlp import TANH, Mlp, parse_mlp
from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.off_policy.actor_net import ActorNet
from sb3_speedups.common.off_policy.batches import OffPolicyBatches
from sb3_speedups.common.off_policy.critics import (
    actor_and_critic_training_reason,
    SoftUpdate,
    StackedCritics,
    stock_actor_reason,
    parameters_only_in,
    polyak_,
    without_weight_gradients,
)


def td3_unsupported_reason(policy: TD3Policy) -> str | None:
    """:return: why :class:`HandDerivedTD3Update` cannot run ``policy``, or ``None`` when it can"""
    actor = policy.actor
    reason = stock_actor_reason(actor, Actor)
    if reason is not None:
        return reason
    mlp = parse_mlp(actor.mu)
    if isinstance(mlp, str):
        return f"actor: {mlp}"
    hidden, last = mlp.head()
    if not hidden.layers or last is None or last.activation is not TANH or last.bias is None:
        return "actor is not hidden layers and a Linear layer squashed by Tanh"
    reason = hidden.trainable_reason()
    if reason is not None:
        return f"actor: {reason}"
    return actor_and_critic_training_reason(actor, policy.critic)


@dataclass
class TD3StepLosses:
    """Per gradient step losses of one ``train()`` call, kept as tensors (read once at its end)."""

    actor: list[th.Tensor]
    critic: list[th.Tensor]


def _actor_net(actor: Actor, optimizer: th.optim.Optimizer | None) -> ActorNet:
    mlp = parse_mlp(actor.mu)
    assert isinstance(mlp, Mlp)
    hidden, last = mlp.head()
    assert last is not None and last.bias is not None
    return ActorNet(actor, hidden, [last.weight], [last.bias], optimizer)


class HandDerivedTD3Update:
    """
    TD3's gradient step (check :func:`td3_unsupported_reason` first). Building it moves the actor's, the critics'
    and their targets' parameters into flat buffers.

    :param policy: the TD3 (or DDPG) policy
    """

    def __init__(self, policy: TD3Policy) -> None:
        reason = td3_unsupported_reason(policy)
        if reason is not None:
            raise ValueError(reason)
        self.policy = policy
        self.actor = _actor_net(policy.actor, policy.actor.optimizer)
        self.actor_target = _actor_net(policy.actor_target, None)
        self.critics = StackedCritics(policy.critic, policy.critic_target, policy.critic.optimizer)
        self._noise: dict[int, th.Tensor] = {}

    def is_bound(self) -> bool:
        """:return: whether every parameter and optimizer state still lives in the flat buffers"""
        return self.actor.is_bound() and self.actor_target.is_bound() and self.critics.is_bound()

    def _noise_buffer(self, like: th.Tensor) -> th.Tensor:
        noise = self._noise.get(like.shape[0])
        if noise is None:
            with th.inference_mode(False):
                noise = self._noise[like.shape[0]] = th.empty_like(like)
        return noise

    def step(
        self,
        batches: OffPolicyBatches,
        k: int,
        update_actor: bool,
        noise_std: float,
        noise_clip: float,
        tau: float,
        losses: TD3StepLosses,
    ) -> None:
        """
        One gradient step of ``TD3.train`` on minibatch ``k``.

        :param batches: the minibatches of this ``train()`` call
        :param k: which one
        :param update_actor: a delayed policy update step: the actor and the targets move too
        :param noise_std: the target policy noise's standard deviation
        :param noise_clip: its clipping bound
        :param tau: the polyak coefficient
        :param losses: where to keep this step's losses
        """
        b, obs_dim = batches.batch_size, self.critics.obs_dim
        obs_pair = batches.actor_inputs[k]
        # stock draws the target policy noise with the shape of the minibatch's actions
        noise = self._noise_buffer(batches.actions[k]).normal_(0, noise_std).clamp_(-noise_clip, noise_clip)
        next_actions = th.tanh(self.actor_target.forward(obs_pair[b:])).add_(noise).clamp_(-1, 1)
        next_in = batches.next_critic_inputs[k]
        next_in[:, obs_dim:] = next_actions
        target = batches.rewards[k] + batches.discounts[k] * self.critics.target_min(next_in)
        losses.critic.append(self.critics.step(batches.critic_inputs[k], target, 1.0))
        if not update_actor:
            return
        actions = th.tanh(self.actor.forward(obs_pair[:b]))
        pi_in = batches.actor_critic_inputs[k]
        pi_in[:, obs_dim:] = actions
        q = self.critics.first_q_values(pi_in)
        losses.actor.append(-q.mean())
        d_q = th.full_like(q, -1.0 / b)
        d_out = self.critics.action_grad(d_q, first=True).mul_(1 - actions**2)
        self.actor.step(d_out)
        self.critics.polyak(tau)
        polyak_(self.actor_target.flat.data, self.actor.flat.data, tau)


class AutogradTD3Update:
    """
    TD3's gradient step with autograd, for any policy (CNN and ``Dict`` observations, custom networks and
    optimizers): stock's losses, with the flat fused Adam where the optimizer is a plain Adam over its network
    (:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep`; not for the critics when they share the actor's
    features extractor: stock's critic optimizer holds it but never steps it, its gradient being ``None`` there), no
    critic weight gradients for the actor loss (a shared features extractor still gets the actor's), stock's target
    updates in foreach calls (:class:`~sb3_speedups.common.off_policy.critics.SoftUpdate`: running statistics
    copied), and no host sync.

    :param policy: the TD3 (or DDPG) policy
    """

    def __init__(self, policy: TD3Policy) -> None:
        self.policy = policy
        self.critic_only = parameters_only_in(policy.critic, policy.actor)
        shares = len(self.critic_only) < len(list(policy.critic.parameters()))
        self.actor_step = FlatOptimizerStep(policy.actor, policy.actor.optimizer)
        self.critic_step = FlatOptimizerStep(policy.critic, policy.critic.optimizer, flat=not shares)
        self.soft_updates = [
            SoftUpdate.between(policy.critic, policy.critic_target),
            SoftUpdate.between(policy.actor, policy.actor_target),
        ]

    def is_bound(self) -> bool:
        """:return: whether the optimizers are still the policy's and their state lives in the flat buffers"""
        actor, critic = self.policy.actor, self.policy.critic
        return self.actor_step.is_bound(actor.optimizer) and self.critic_step.is_bound(critic.optimizer)

    def step(
        self,
        data: ReplayBufferSamples,
        gamma: float,
        update_actor: bool,
        noise_std: float,
        noise_clip: float,
        tau: float,
        losses: TD3StepLosses,
    ) -> None:
        """One gradient step of ``TD3.train`` on one minibatch (arguments as :meth:`HandDerivedTD3Update.step`)."""
        policy = self.policy
        discounts = data.discounts if data.discounts is not None else gamma
        with th.no_grad():
            noise = th.empty_like(data.actions).normal_(0, noise_std).clamp_(-noise_clip, noise_clip)
            next_actions = (policy.actor_target(data.next_observations) + noise).clamp(-1, 1)
            next_q = th.cat(policy.critic_target(data.next_observations, next_actions), dim=1)
            next_q = th.min(next_q, dim=1, keepdim=True).values
            target = data.rewards + (1 - data.dones) * discounts * next_q
        critic_loss = sum(F.mse_loss(q, target) for q in policy.critic(data.observations, data.actions))
        assert isinstance(critic_loss, th.Tensor)
        losses.critic.append(critic_loss.detach())
        self.critic_step.backward(critic_loss)
        self.critic_step.step()
        if not update_actor:
            return
        with without_weight_gradients(self.critic_only):
            actor_loss = -policy.critic.q1_forward(data.observations, policy.actor(data.observations)).mean()
            losses.actor.append(actor_loss.detach())
            self.actor_step.backward(actor_loss)
        self.actor_step.step()
        for soft_update in self.soft_updates:
            soft_update(tau)
