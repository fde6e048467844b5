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

The maths and the tests that check it: docs/maths.md, "SAC actor" and "Off-policy critics".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch as th
from stable_baselines3.sac.policies import Actor, SACPolicy

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.mlp import Mlp, parse_mlp
from sb3_speedups.common.nn.optim import FlatAdam, adam_unsupported_reason
from sb3_speedups.common.off_policy.actor_net import ActorNet
from sb3_speedups.common.off_policy.critics import StackedCritics, critic_unsupported_reason, flat_box_reason
from sb3_speedups.common.off_policy.batches import OffPolicyBatches
from sb3_speedups.sac.squashed_gaussian import sample_squashed, squashed_backward


def sac_unsupported_reason(policy: SACPolicy, use_sde: bool) -> str | None:
    """:return: why :class:`HandDerivedSACUpdate` cannot run ``policy``, or ``None`` when it can"""
    if use_sde:
        return "gSDE"
    actor = policy.actor
    if type(actor) is not Actor:
        return f"actor class {type(actor).__name__} is not the stock Actor"
    reason = flat_box_reason(actor.observation_space, actor.features_extractor)
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
    if any(p.dtype != th.float32 for p in actor.parameters()):
        return "actor parameters are not float32"
    reason = adam_unsupported_reason(actor.optimizer, list(actor.parameters()))
    return reason or critic_unsupported_reason(policy.critic, policy.critic.optimizer)


@dataclass
class SACStepLosses:
    """Per gradient step values of one ``train()`` call, kept as tensors (read once at its end)."""

    actor: list[th.Tensor]
    critic: list[th.Tensor]
    ent_coef: list[th.Tensor]
    ent_coef_loss: list[th.Tensor]


class HandDerivedSACUpdate:
    """
    SAC's gradient step (check :func:`sac_unsupported_reason` first). Building it moves the actor's, the critics' and
    the target critics' parameters (and ``log_ent_coef``) into flat buffers.

    :param policy: the SAC policy
    :param log_ent_coef: the learned log entropy coefficient, or ``None`` when it is fixed
    :param ent_coef_optimizer: its Adam (with ``log_ent_coef``)
    :param ent_coef: the fixed entropy coefficient (a 0-dim tensor), when not learned
    :param target_entropy: the entropy target of the learned coefficient
    """

    def __init__(
        self,
        policy: SACPolicy,
        log_ent_coef: th.Tensor | None,
        ent_coef_optimizer: th.optim.Optimizer | None,
        ent_coef: th.Tensor | None,
        target_entropy: float,
    ) -> None:
        reason = sac_unsupported_reason(policy, use_sde=False)
        if reason is not None:
            raise ValueError(reason)
        self.policy = policy
        actor = policy.actor
        hidden = parse_mlp(actor.latent_pi)
        assert isinstance(hidden, Mlp)
        mu, log_std = cast(th.nn.Linear, actor.mu), cast(th.nn.Linear, actor.log_std)  # checked above
        self.actor = ActorNet(actor, hidden, [mu.weight, log_std.weight], [mu.bias, log_std.bias], actor.optimizer)
        self.critics = StackedCritics(policy.critic, policy.critic_target, policy.critic.optimizer)
        self.action_dim = mu.out_features
        self.ent_flat: FlatParameters | None = None
        self.ent_adam: FlatAdam | None = None
        if log_ent_coef is not None and ent_coef_optimizer is not None:
            self.ent_flat = FlatParameters([log_ent_coef])
            self.ent_adam = FlatAdam(self.ent_flat, ent_coef_optimizer)
        self.fixed_ent_coef = ent_coef
        self.target_entropy = target_entropy
        self._noise: dict[int, th.Tensor] = {}

    def is_bound(self) -> bool:
        """:return: whether every parameter and optimizer state still lives in the flat buffers"""
        ent = self.ent_flat is None or (self.ent_flat.is_bound() and self.ent_adam is not None and self.ent_adam.is_bound())
        return self.actor.is_bound() and self.critics.is_bound() and ent

    def _ent_coef(self, log_prob: th.Tensor, losses: SACStepLosses) -> th.Tensor:
        """:return: this step's entropy coefficient (``[1]``), after stepping the learned one as stock does"""
        if self.ent_flat is None or self.ent_adam is None:
            assert self.fixed_ent_coef is not None
            losses.ent_coef.append(self.fixed_ent_coef)
            return self.fixed_ent_coef
        log_ent_coef = self.ent_flat.data
        ent_coef = th.exp(log_ent_coef)  # read before the step below changes log_ent_coef
        losses.ent_coef.append(ent_coef)
        shifted = log_prob + self.target_entropy
        losses.ent_coef_loss.append(-(log_ent_coef * shifted).mean())
        # d/d log_ent_coef of -mean(log_ent_coef * (log_prob + target_entropy))
        th.sum(shifted * (-1.0 / shifted.shape[0]), dim=0, out=self.ent_flat.grad)
        self.ent_adam.step()
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
        next_q = self.critics.target_min(next_in) - ent_coef * log_prob[b:]
        target = batches.rewards[k] + batches.discounts[k] * next_q
        losses.critic.append(self.critics.step(batches.critic_inputs[k], target, 0.5))
        pi_in = batches.actor_critic_inputs[k]
        pi_in[:, obs_dim:] = sample.actions[:b]
        min_q, argmin = th.min(self.critics.q_values(pi_in), dim=0)
        losses.actor.append((ent_coef * log_prob[:b] - min_q).mean())
        d_q = th.zeros(self.critics.groups, b, 1, device=min_q.device).scatter_(0, argmin.unsqueeze(0), -1.0 / b)
        d_actions = self.critics.action_grad(d_q)
        self.actor.step(squashed_backward(sample, b, d_actions, ent_coef / b))
        if update_target:
            self.critics.polyak(tau)
