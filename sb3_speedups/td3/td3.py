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


import stable_baselines3
import torch as th

from sb3_speedups.common.off_policy.algorithm import FastOffPolicyAlgorithm
from sb3_speedups.common.off_policy.training import mean_of, minibatches, split_minibatches
from sb3_speedups.common.torch_utils import num_threads_during, update_num_threads
from sb3_speedups.td3.update import AutogradTD3Update, HandDerivedTD3Update, TD3StepLosses, td3_unsupported_reason


class TD3(FastOffPolicyAlgorithm, stable_baselines3.TD3):
    """
    Twin Delayed DDPG, a drop-in for :class:`stable_baselines3.TD3` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`stable_baselines3.TD3` for every argument not listed here.

    See :class:`~sb3_speedups.common.off_policy.algorithm.FastOffPolicyAlgorithm` for ``num_threads`` and
    ``fast_update``.
    """

    def _unsupported_reason(self) -> str | None:
        return td3_unsupported_reason(self.policy)

    def _make_updater(self, reason: str | None) -> HandDerivedTD3Update | AutogradTD3Update:
        return HandDerivedTD3Update(self.policy) if reason is None else AutogradTD3Update(self.policy)

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
        self.logger.record("train/n_updates", self._n_updates, exclude="tensorboard")
        if losses.actor:
            self.logger.record("train/actor_loss", mean_of(losses.actor))
        self.logger.record("train/critic_loss", mean_of(losses.critic))
        return None
