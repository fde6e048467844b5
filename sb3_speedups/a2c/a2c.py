"""
A2C as in Stable-Baselines3, faster. What differs from stock, and why it is faster:

- collection is the on-policy base's (:class:`~sb3_speedups.common.on_policy.base.FastOnPolicy`, as PPO's): it acts
  from a frozen plain-tensor copy of the policy (:mod:`sb3_speedups.common.acting.actors`), synced once per rollout,
  one batched call per vectorised step, into a buffer allocated once
  (:class:`~sb3_speedups.common.on_policy.buffers.FastRolloutBuffer`);
- ``train()``'s one gradient step on the whole rollout is :class:`~sb3_speedups.a2c.update.HandDerivedA2CUpdate`
  (hand-derived gradients, flat buffers, one flat RMSprop or Adam step) for MLP policies, else the autograd
  :class:`~sb3_speedups.a2c.update.AutogradA2CUpdate`; its statistics are read in one host sync. A NatureCNN
  policy's update starts from the convolutions' outputs that acting kept (:mod:`sb3_speedups.a2c.kept_cnn`): no
  second forward through them;
- torch runs on one CPU thread unless the user chose otherwise (faster and steadier for small networks).

The maths, the defaults and the RNG draws are stock SB3's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import stable_baselines3
import torch as th
from stable_baselines3.common.utils import explained_variance

from sb3_speedups.a2c.kept_cnn import KeptConvActorCritic, kept_conv_reason, kept_conv_update
from sb3_speedups.a2c.update import A2CLossConfig, AutogradA2CUpdate, HandDerivedA2CUpdate
from sb3_speedups.common.acting.actors import FrozenActorCritic, ModuleActorCritic
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.nn.optim import flat_optimizer_unsupported_reason
from sb3_speedups.common.on_policy.base import FastOnPolicy, OnPolicySpeedups
from sb3_speedups.common.on_policy.buffers import FastRolloutBase
from sb3_speedups.common.on_policy.fast_paths import mlp_model_unsupported_reason


@dataclass
class _RolloutViews:
    """The flat training inputs of one rollout buffer on its own device: views made once, the same every update."""

    buffer: FastRolloutBase
    #: ``[n, obs_dim]``, or ``Dict`` observations' entries ``[n, ...]``
    observations: th.Tensor | dict[str, th.Tensor]
    actions: th.Tensor
    advantages: th.Tensor
    returns: th.Tensor

    @classmethod
    def of(cls, buffer: FastRolloutBase) -> _RolloutViews:
        """:return: the views (observations ``[n, obs_dim]`` in the buffer's dtype: the update converts others than float32)"""
        observations = buffer.flat_observations()
        x = observations if isinstance(observations, dict) else observations.reshape(observations.shape[0], -1)
        return cls(buffer, x, *(buffer.flat(name) for name in ("actions", "advantages", "returns")))


@dataclass
class A2CSpeedups(OnPolicySpeedups):
    """A2C's speed-only state: its updater, frozen actor and the rollout's kept views."""

    updater: HandDerivedA2CUpdate | AutogradA2CUpdate
    #: whether the policy has a ``log_std`` parameter (whose mean ``train()`` logs)
    has_log_std: bool = False
    views: _RolloutViews | None = None


class A2C(FastOnPolicy, stable_baselines3.A2C):
    """
    Advantage Actor Critic, a drop-in for :class:`stable_baselines3.A2C` (same arguments, ``learn``, ``predict``,
    saved files); see :class:`stable_baselines3.A2C` for every argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param inference_device: where collection acts, from a copy of the policy synced once per rollout (with a GPU
        ``device``: training on the GPU, acting on the CPU); ``"auto"`` acts on the training device
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces the autograd update)
    """

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        reason = mlp_model_unsupported_reason(self)
        return reason or flat_optimizer_unsupported_reason(self.policy.optimizer, list(self.policy.parameters()))

    def _build_speedups(self, reason: str | None) -> A2CSpeedups:
        device = self._inference_device()
        if reason is None:
            head = make_head(self.policy.action_dist, self.action_space)
            assert head is not None
            updater: HandDerivedA2CUpdate | AutogradA2CUpdate = HandDerivedA2CUpdate(self.policy, head)
            actor: FrozenActorCritic | ModuleActorCritic = FrozenActorCritic(self.policy, head, device)
        else:
            updater = AutogradA2CUpdate(self.policy)
            rows = self.n_steps * self.n_envs
            if kept_conv_reason(self.policy, rows, device) is None:
                actor = KeptConvActorCritic(self.policy, rows)  # the update starts from acting's convolutions
            else:
                actor = ModuleActorCritic(self.policy, device)
            if self.verbose >= 1:
                print(f"sb3_speedups A2C: using the autograd update ({reason})")
        return A2CSpeedups(updater, actor, reason, isinstance(getattr(self.policy, "log_std", None), th.Tensor))

    # ----- update -------------------------------------------------------------------------------------------------

    def train(self) -> None:
        """One gradient step on the whole rollout: SB3's A2C loss, minus its per-update overheads."""
        buffer = self.rollout_buffer
        if not isinstance(buffer, FastRolloutBase):
            return super().train()
        speed = self._ensure_speedups()
        self._set_training_mode(True)
        self._update_learning_rate(self.policy.optimizer)
        cfg = A2CLossConfig(
            float(self.ent_coef), float(self.vf_coef), float(self.max_grad_norm), bool(self.normalize_advantage)
        )
        updater = speed.updater
        if isinstance(updater, HandDerivedA2CUpdate):
            # Stock's get() draws a permutation of the rollout; drawing it too keeps numpy's global RNG in step with
            # stock's (the loss is a mean over the rollout: the order would change only its rounding).
            np.random.permutation(buffer.buffer_size * buffer.n_envs)
            views = speed.views
            if views is None or views.buffer is not buffer:
                views = speed.views = _RolloutViews.of(buffer)
            device = self.device
            actions, advantages, returns = (t.to(device) for t in (views.actions, views.advantages, views.returns))
            observations = views.observations
            observations = (
                {k: v.to(device) for k, v in observations.items()}
                if isinstance(observations, dict)
                else observations.to(device)
            )
            with th.inference_mode():  # no autograd is needed: without its dispatch every op is cheaper
                stats = updater.update(observations, actions, advantages, returns, cfg)
        elif isinstance(speed.actor, KeptConvActorCritic) and speed.actor.complete():
            np.random.permutation(buffer.buffer_size * buffer.n_envs)  # stock's get(), as above
            observations = buffer.flat_observations()
            assert isinstance(observations, th.Tensor)
            actions, advantages, returns = (buffer.flat(name) for name in ("actions", "advantages", "returns"))
            stats = kept_conv_update(speed.actor, updater.step, observations, actions, advantages, returns, cfg)
        else:
            stats = updater.update(next(self.rollout_buffer.get(batch_size=None)), cfg)  # the whole rollout is one batch
        self._n_updates += 1
        self._record_train_stats(stats, speed.has_log_std)

    def _record_train_stats(self, stats: th.Tensor, has_log_std: bool) -> None:
        """Record what stock A2C records after ``train()`` (one host sync for the losses)."""
        policy_loss, value_loss, entropy_loss = stats.tolist()
        buffer = self.rollout_buffer
        logger = self.logger
        logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        logger.record("train/explained_variance", explained_variance(buffer.values.reshape(-1), buffer.returns.reshape(-1)))
        logger.record("train/entropy_loss", entropy_loss)
        logger.record("train/policy_loss", policy_loss)
        logger.record("train/value_loss", value_loss)
        if has_log_std:
            logger.record("train/std", th.exp(self.policy.log_std).mean().item())
