"""
A2C as in Stable-Baselines3, faster. What differs from stock, and why it is faster:

- collection is PPO's (:func:`sb3_speedups.ppo.collection.collect_rollout`): it acts from a frozen plain-tensor copy
  of the policy (:mod:`sb3_speedups.common.acting.actors`), synced once per rollout, one batched call per vectorised
  step, into a buffer allocated once (:class:`~sb3_speedups.ppo.buffers.FastRolloutBuffer`);
- ``train()``'s one gradient step on the whole rollout is :class:`~sb3_speedups.a2c.update.HandDerivedA2CUpdate`
  (hand-derived gradients, flat buffers, one flat RMSprop or Adam step) for MLP policies, else the autograd
  :class:`~sb3_speedups.a2c.update.AutogradA2CUpdate`; its statistics are read in one host sync;
- torch runs on one CPU thread unless the user chose otherwise (faster and steadier for small networks).

The maths, the defaults and the RNG draws are stock SB3's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import stable_baselines3
import torch as th
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import explained_variance
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.a2c.update import A2CLossConfig, AutogradA2CUpdate, HandDerivedA2CUpdate
from sb3_speedups.common.acting.actors import FrozenActorCritic, ModuleActorCritic
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.nn.optim import flat_optimizer_unsupported_reason
from sb3_speedups.common.on_policy.fast_paths import mlp_model_unsupported_reason
from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.ppo.buffers import FastRolloutBase, install_fast_rollout_buffer
from sb3_speedups.ppo.collection import collect_rollout


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
class _Speedups:
    """Speed-only state, rebuilt whenever the policy's parameters or optimizer state are replaced (never saved)."""

    updater: HandDerivedA2CUpdate | AutogradA2CUpdate
    actor: FrozenActorCritic | ModuleActorCritic
    fallback_reason: str | None
    #: whether the policy has a ``log_std`` parameter (whose mean ``train()`` logs)
    has_log_std: bool = False
    views: _RolloutViews | None = None


class A2C(FastModel, stable_baselines3.A2C):
    """
    Advantage Actor Critic, a drop-in for :class:`stable_baselines3.A2C` (same arguments, ``learn``, ``predict``,
    saved files); see :class:`stable_baselines3.A2C` for every argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param inference_device: where collection acts, from a copy of the policy synced once per rollout (with a GPU
        ``device``: training on the GPU, acting on the CPU); ``"auto"`` acts on the training device
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces the autograd update)
    """

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        num_threads: int | None = None,
        inference_device: str = "cpu",
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(policy, env, _init_setup_model=False, **kwargs)
        self.num_threads = num_threads
        self.inference_device = inference_device
        self.fast_update = fast_update
        self._speedups: _Speedups | None = None
        if _init_setup_model:
            self._setup_model()

    def _after_stock_setup(self) -> None:
        install_fast_rollout_buffer(self)

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        reason = mlp_model_unsupported_reason(self)
        return reason or flat_optimizer_unsupported_reason(self.policy.optimizer, list(self.policy.parameters()))

    def _ensure_speedups(self) -> _Speedups:
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound():
            return speed
        reason = self.fast_path_unsupported_reason()
        device = self.device if self.inference_device == "auto" else th.device(self.inference_device)
        if reason is None:
            head = make_head(self.policy.action_dist, self.action_space)
            assert head is not None
            updater: HandDerivedA2CUpdate | AutogradA2CUpdate = HandDerivedA2CUpdate(self.policy, head)
            actor: FrozenActorCritic | ModuleActorCritic = FrozenActorCritic(self.policy, head, device)
        else:
            updater = AutogradA2CUpdate(self.policy)
            actor = ModuleActorCritic(self.policy, device)
            if self.verbose >= 1:
                print(f"sb3_speedups A2C: using the autograd update ({reason})")
        self._speedups = _Speedups(updater, actor, reason, isinstance(getattr(self.policy, "log_std", None), th.Tensor))
        return self._speedups

    # ----- collection and update ----------------------------------------------------------------------------------

    def collect_rollouts(
        self, env: VecEnv, callback: BaseCallback, rollout_buffer: RolloutBuffer, n_rollout_steps: int
    ) -> bool:
        if not isinstance(rollout_buffer, FastRolloutBase):
            return super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)
        speed = self._ensure_speedups()
        speed.actor.sync()
        return collect_rollout(self, env, callback, rollout_buffer, n_rollout_steps, speed.actor, self.gamma)

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
        else:
            stats = updater.update(next(buffer.get(batch_size=None)), cfg)  # the whole rollout is one batch
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
