"""
TRPO as in sb3-contrib, faster. What differs from stock, and why it is faster:

- collection is PPO's (:func:`sb3_speedups.common.on_policy.collection.collect_rollout`, through
  :class:`~sb3_speedups.common.on_policy.base.FastOnPolicy`): it acts from a frozen plain-tensor copy of the policy,
  synced once per rollout, into a buffer allocated once;
- ``train()`` for MLP policies is :class:`~sb3_speedups.trpo.update.HandDerivedTRPOUpdate`: the surrogate gradient by
  hand, the KL Hessian-vector products of the conjugate gradient by a forward tangent pass and a backward through the
  kept activations (no double-backward graph, :mod:`sb3_speedups.trpo.natural_gradient`), the line search on the
  actor's flat parameter range, the critic's epochs on the hand-derived value path with one fused Adam call per
  minibatch; everything else (gSDE, CNNs, other optimizers) runs stock's ``train()`` after our collection;
- torch runs on one CPU thread for small MLPs unless the user chose otherwise.

The maths, the defaults and the RNG draws are stock sb3-contrib's.
"""

from __future__ import annotations

from dataclasses import dataclass

import sb3_contrib
import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.utils import explained_variance

from sb3_speedups.common.acting.actors import FrozenActorCritic, ModuleActorCritic
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.nn.optim import adam_unsupported_reason
from sb3_speedups.common.on_policy.base import FastOnPolicy, OnPolicySpeedups
from sb3_speedups.common.on_policy.buffers import FastRolloutBase
from sb3_speedups.common.on_policy.fast_paths import mlp_model_unsupported_reason
from sb3_speedups.trpo.natural_gradient import make_output_fisher
from sb3_speedups.trpo.update import (
    HandDerivedTRPOUpdate,
    Rollout,
    TRPOConfig,
    actor_and_critic,
    actor_order_reason,
    align_actor_adam_state,
)


@dataclass
class StockTRPOUpdate:
    """The fallback's update: stock's ``train()`` (gSDE, CNNs, other optimizers); it holds nothing to go stale."""

    policy: ActorCriticPolicy

    def is_bound(self) -> bool:
        """:return: always ``True`` (stock's code reads the policy as it is)"""
        return True


class TRPO(FastOnPolicy, sb3_contrib.TRPO):
    """
    Trust Region Policy Optimization, a drop-in for :class:`sb3_contrib.TRPO` (same arguments, ``learn``,
    ``predict``, saved files); see :class:`sb3_contrib.TRPO` for every argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else chooses from the network's shapes
    :param inference_device: where collection acts, from a copy of the policy synced once per rollout (with a GPU
        ``device``: training on the GPU, acting on the CPU); ``"auto"`` acts on the training device
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces stock's ``train()``)
    """

    def _unsupported_reason(self) -> str | None:
        reason = mlp_model_unsupported_reason(self)
        if reason is not None:
            return reason
        head = make_head(self.policy.action_dist, self.action_space)
        if head is None or make_output_fisher(head) is None:
            return f"action distribution {type(self.policy.action_dist).__name__} has no hand-derived KL Hessian"
        reason = actor_order_reason(self.policy)
        if reason is not None:
            return reason
        # A model stock trained holds Adam state for its critic only (or stale actor counts); aligning changes no number.
        align_actor_adam_state(self.policy.optimizer, *actor_and_critic(self.policy))
        return adam_unsupported_reason(self.policy.optimizer, list(self.policy.parameters()))

    def _build_speedups(self, reason: str | None) -> OnPolicySpeedups:
        device = self._inference_device()
        if reason is None:
            head = make_head(self.policy.action_dist, self.action_space)
            assert head is not None
            fisher = make_output_fisher(head)
            assert fisher is not None
            updater: HandDerivedTRPOUpdate | StockTRPOUpdate = HandDerivedTRPOUpdate(self.policy, head, fisher)
            actor: FrozenActorCritic | ModuleActorCritic = FrozenActorCritic(self.policy, head, device)
        else:
            updater = StockTRPOUpdate(self.policy)
            actor = ModuleActorCritic(self.policy, device)
            if self.verbose >= 1:
                print(f"sb3_speedups TRPO: using stock's train() ({reason})")
        return OnPolicySpeedups(updater, actor, reason)

    def _config(self) -> TRPOConfig:
        return TRPOConfig(
            int(self.cg_max_steps),
            float(self.cg_damping),
            float(self.line_search_shrinking_factor),
            int(self.line_search_max_iter),
            float(self.target_kl),
            bool(self.normalize_advantage),
            int(self.sub_sampling_factor),
        )

    def _rollout(self, buffer: FastRolloutBase, updater: HandDerivedTRPOUpdate) -> Rollout:
        device = self.device
        observations = buffer.flat_observations()
        if isinstance(observations, dict):
            obs: th.Tensor | dict[str, th.Tensor] = {k: v.to(device) for k, v in observations.items()}
        else:
            obs = observations.reshape(observations.shape[0], -1).to(device)
        actions, log_probs, advantages, returns = (
            buffer.flat(name).to(device) for name in ("actions", "log_probs", "advantages", "returns")
        )
        x = updater.net.inputs(obs)
        return Rollout(x, actions, log_probs, advantages, returns, buffer.buffer_size, buffer.n_envs)

    def train(self) -> None:
        """Stock TRPO's update (one natural-gradient policy step, then the critic's epochs), minus its overheads."""
        buffer = self.rollout_buffer
        speed = self._ensure_speedups() if isinstance(buffer, FastRolloutBase) else None
        updater = None if speed is None else speed.updater
        if not isinstance(updater, HandDerivedTRPOUpdate):
            return super().train()
        assert isinstance(buffer, FastRolloutBase)
        self._set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        rollout = self._rollout(buffer, updater)
        with th.inference_mode():  # no autograd is needed: without its dispatch every op is cheaper
            objective, kl, success = updater.policy_step(rollout, self._config())
            value_loss = updater.critic_epochs(rollout, self.batch_size, self.n_critic_updates)
        self._n_updates += 1
        logger = self.logger
        logger.record("train/policy_objective", objective)
        logger.record("train/value_loss", value_loss)
        logger.record("train/kl_divergence_loss", kl)
        logger.record("train/explained_variance", explained_variance(buffer.values.flatten(), buffer.returns.flatten()))
        logger.record("train/is_line_search_success", float(success))
        if hasattr(self.policy, "log_std"):
            logger.record("train/std", th.exp(self.policy.log_std).mean().item())
        logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
