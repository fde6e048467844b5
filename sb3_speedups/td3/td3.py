"""
TD3 as in Stable-Baselines3, faster (and, through :class:`sb3_speedups.DDPG`, DDPG). What differs from stock, and
why it is faster:

- ``train()`` samples its minibatches many at a time (the same global-RNG draws as stock:
  :mod:`sb3_speedups.common.replay.sampling`) and lays them out once (:mod:`sb3_speedups.common.off_policy.batches`);
- each gradient step is :class:`~sb3_speedups.td3.update.HandDerivedTD3Update` for MLP policies (hand-derived
  gradients, stacked critics, flat parameters, fused Adam, no host sync), the same steps as stock's with the same
  target-noise draws; the losses are logged once per ``train()``;
- torch threads as for SAC (:class:`sb3_speedups.SAC`).

CNN and ``Dict`` observations, custom policies and optimizers run
:class:`~sb3_speedups.td3.update.AutogradTD3Update` (stock's losses through autograd, flat fused Adam, no critic weight
gradients for the actor loss, minibatches sampled ahead).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import stable_baselines3
import torch as th

from sb3_speedups.common.acting.off_policy import FrozenActorSampling, FrozenOffPolicyActor
from sb3_speedups.common.off_policy.collection import FastOffPolicyCollection
from sb3_speedups.common.off_policy.training import check_tau, largest_linear, mean_of, minibatches, split_minibatches
from sb3_speedups.common.torch_utils import apply_num_threads, num_threads_during, update_num_threads
from sb3_speedups.td3.update import AutogradTD3Update, HandDerivedTD3Update, TD3StepLosses, td3_unsupported_reason


@dataclass
class _Speedups:
    """Speed-only state, rebuilt when the policy or its optimizer state is replaced (never saved)."""

    updater: HandDerivedTD3Update | AutogradTD3Update
    fallback_reason: str | None
    #: inputs x outputs of the largest ``Linear`` layer (for the update's thread count)
    largest_linear: int
    #: the actor's frozen copy that acts during collection (with the hand-derived update), else ``None``
    actor: FrozenOffPolicyActor | None


class TD3(FrozenActorSampling, FastOffPolicyCollection, stable_baselines3.TD3):
    """
    Twin Delayed DDPG, a drop-in for :class:`stable_baselines3.TD3` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`stable_baselines3.TD3` for every argument not listed here.

    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces the autograd update)
    """

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        num_threads: int | None = None,
        fast_update: bool = True,
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        check_tau(kwargs.get("tau", 0.005))
        super().__init__(policy, env, _init_setup_model=False, **kwargs)
        self.num_threads = num_threads
        self.fast_update = fast_update
        self._speedups: _Speedups | None = None
        if _init_setup_model:
            self._setup_model()

    def _setup_model(self) -> None:
        apply_num_threads(self.num_threads)
        super()._setup_model()
        self._speedups = None

    def _excluded_save_params(self) -> list[str]:
        return [*super()._excluded_save_params(), "_speedups"]

    def fast_path_unsupported_reason(self) -> str | None:
        """:return: why the hand-derived update cannot run this model (so the autograd one does), or ``None``"""
        if not self.fast_update:
            return "fast_update=False"
        return td3_unsupported_reason(self.policy)

    def _ensure_speedups(self) -> _Speedups:
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound():
            return speed
        reason = self.fast_path_unsupported_reason()
        updater: HandDerivedTD3Update | AutogradTD3Update
        if reason is None:
            updater = HandDerivedTD3Update(self.policy)
        else:
            updater = AutogradTD3Update(self.policy)
            if self.verbose >= 1:
                print(f"sb3_speedups {type(self).__name__}: using the autograd update ({reason})")
        actor = FrozenOffPolicyActor(self.actor) if reason is None else None
        self._speedups = _Speedups(updater, reason, largest_linear(self.actor, self.critic), actor)
        return self._speedups

    def train(self, gradient_steps: int, batch_size: int = 100) -> None:
        """Stock's TD3 gradient steps (the same updates), hand-derived where the networks allow, else through autograd."""
        speed = self._ensure_speedups()
        updater = speed.updater
        self._set_training_mode(True)
        self._update_learning_rate([self.actor.optimizer, self.critic.optimizer])
        losses = TD3StepLosses([], [])
        threads = update_num_threads(batch_size * speed.largest_linear, self.num_threads, self.device)
        noise = (self.target_policy_noise, self.target_noise_clip)
        if isinstance(updater, AutogradTD3Update):
            with num_threads_during(threads):
                for data in split_minibatches(self, gradient_steps, batch_size):
                    self._n_updates += 1
                    updater.step(data, self.gamma, self._n_updates % self.policy_delay == 0, *noise, self.tau, losses)
        else:
            # The hand-derived update needs no autograd: without its dispatch every op is cheaper.
            with num_threads_during(threads), th.inference_mode():
                for _, batches in minibatches(self, gradient_steps, batch_size):
                    for k in range(batches.rewards.shape[0]):
                        self._n_updates += 1
                        updater.step(batches, k, self._n_updates % self.policy_delay == 0, *noise, self.tau, losses)
        if speed.actor is not None:
            speed.actor.sync()
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if losses.actor:
            self.logger.record("train/actor_loss", mean_of(losses.actor))
        self.logger.record("train/critic_loss", mean_of(losses.critic))
        return None
