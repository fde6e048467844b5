"""
SAC as in Stable-Baselines3, faster. What differs from stock, and why it is faster:

- ``train()`` samples its minibatches many at a time (the same global-RNG draws as stock:
  :mod:`sb3_speedups.common.replay.sampling`) and lays them out once (:mod:`sb3_speedups.common.off_policy.batches`);
- each gradient step is :class:`~sb3_speedups.sac.update.HandDerivedSACUpdate` for MLP policies (hand-derived
  gradients, stacked critics, flat parameters, fused Adam, no host sync), the same steps as stock's with the same
  torch RNG draws; the losses are logged once per ``train()``;
- torch runs on one CPU thread unless the user chose otherwise, except in ``train()`` when the matrix products are
  large (the RL Zoo's 256x256 nets): there two threads are faster.

gSDE, CNN and ``Dict`` observations, custom policies and optimizers run
:class:`~sb3_speedups.sac.update.AutogradSACUpdate` (stock's losses through autograd, flat fused Adam, no critic weight
gradients for the actor loss, minibatches sampled ahead).
"""

from __future__ import annotations

from typing import Any

import stable_baselines3
import torch as th

from sb3_speedups.common.off_policy.algorithm import FastOffPolicyAlgorithm
from sb3_speedups.common.off_policy.training import minibatches, split_minibatches
from sb3_speedups.common.torch_utils import num_threads_during, update_num_threads
from sb3_speedups.errors import UserValueError
from sb3_speedups.sac.critic_loss import MinCriticLoss, SoftCriticLoss
from sb3_speedups.sac.update import AutogradSACUpdate, HandDerivedSACUpdate, SACStepLosses, sac_unsupported_reason


def check_ent_coef(ent_coef: Any) -> None:
    """
    Raise a one-line ``ValueError`` for an entropy coefficient string stock SAC cannot read (where it raises a bare
    one): ``"auto"`` (any string starting so), ``"auto_<initial value>"`` or a number.
    """
    if not isinstance(ent_coef, str):
        return
    value = ent_coef.split("_")[1] if ent_coef.startswith("auto") and "_" in ent_coef else ent_coef
    if value.startswith("auto"):
        return
    try:
        float(value)
    except ValueError:
        raise UserValueError(
            f"ent_coef={ent_coef!r} is invalid: use 'auto', 'auto_<initial value>' (e.g. 'auto_0.1') or a number"
        ) from None


def begin_soft_train(model: Any) -> SACStepLosses:
    """
    What stock's ``train()`` of SAC, TQC and CrossQ does first: training mode on, the learning rates of this progress
    set (actor, critics and a learned entropy coefficient).

    :param model: the model
    :return: the empty per-step values to fill
    """
    model._set_training_mode(True)
    optimizers = [model.actor.optimizer, model.critic.optimizer]
    if model.ent_coef_optimizer is not None:
        optimizers.append(model.ent_coef_optimizer)
    model._update_learning_rate(optimizers)
    return SACStepLosses([], [], [], [])


class SACTraining(FastOffPolicyAlgorithm):
    """
    Mixin, first among the bases of SAC and of the algorithms built on SAC's update (TQC): the entropy coefficient
    check, the choice of update and ``train()``. An algorithm differs in its critics' loss only
    (:meth:`_critic_loss`, a :class:`~sb3_speedups.sac.critic_loss.SoftCriticLoss`).
    """

    log_ent_coef: th.Tensor | None
    ent_coef_optimizer: th.optim.Adam | None
    target_entropy: Any
    target_update_interval: int

    def _check_arguments(self, kwargs: dict[str, Any]) -> None:
        check_ent_coef(kwargs.get("ent_coef", "auto"))
        super()._check_arguments(kwargs)

    def _critic_loss(self) -> SoftCriticLoss:
        """:return: the critics' target, loss and actor value (SAC's: the smallest critic, mean squared error)"""
        return MinCriticLoss()

    def _unsupported_reason(self) -> str | None:
        return sac_unsupported_reason(self.policy, self.use_sde, self._critic_loss())

    def _make_updater(self, reason: str | None) -> HandDerivedSACUpdate | AutogradSACUpdate:
        # (TQC keeps a numpy float32 where SAC keeps a float: the same number)
        target_entropy = float(self.target_entropy)
        ent = (self.log_ent_coef, self.ent_coef_optimizer, getattr(self, "ent_coef_tensor", None), target_entropy)
        if reason is None:
            return HandDerivedSACUpdate(self.policy, *ent, loss=self._critic_loss())
        return AutogradSACUpdate(self.policy, *ent, use_sde=self.use_sde, loss=self._critic_loss())

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        """Stock's SAC gradient steps (the same updates), hand-derived where the networks allow, else through autograd."""
        speed = self._ensure_speedups()
        updater = speed.updater
        losses = begin_soft_train(self)
        threads = update_num_threads(batch_size * speed.largest_linear, self.num_threads, self.device)
        interval = self.target_update_interval
        if isinstance(updater, AutogradSACUpdate):
            with num_threads_during(threads):
                for i, data in enumerate(split_minibatches(self, gradient_steps, batch_size)):
                    updater.step(data, self.gamma, i % interval == 0, self.tau, losses)
        else:
            # The hand-derived update needs no autograd: without its dispatch every op is cheaper.
            with num_threads_during(threads), th.inference_mode():
                for first, batches in minibatches(self, gradient_steps, batch_size):
                    for k in range(batches.rewards.shape[0]):
                        updater.step(batches, k, (first + k) % interval == 0, self.tau, losses)
        self._n_updates += gradient_steps
        losses.record(self.logger, self._n_updates)
        return None


class SAC(SACTraining, stable_baselines3.SAC):
    """
    Soft Actor-Critic, a drop-in for :class:`stable_baselines3.SAC` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`stable_baselines3.SAC` for every argument not listed here.

    See :class:`~sb3_speedups.common.off_policy.algorithm.FastOffPolicyAlgorithm` for ``num_threads`` and
    ``fast_update``.
    """
