"""
CrossQ as in sb3-contrib, faster. CrossQ is SAC without target networks, with batch-renormalised actor and critics
whose statistics come from one joint forward of ``(s, a)`` and ``(s', a')``. Ours runs on the off-policy engine of
our SAC, TD3 and TQC:

- the lean collection loop (:class:`~sb3_speedups.common.off_policy.collection.FastOffPolicyCollection`), acting
  from a frozen copy of the actor whose ``BatchRenorm1d`` layers run their evaluation forward on copies of their
  running statistics (:class:`~sb3_speedups.crossq.acting.EvalRenormMlp`: stock's ``predict``'s numbers);
- ``train()`` samples its minibatches many at a time with stock's RNG draws
  (:func:`~sb3_speedups.common.off_policy.training.split_minibatches`);
- each gradient step is :class:`~sb3_speedups.crossq.update.CrossQUpdate`: stock's losses through autograd with the
  training-mode batch-renormalisation layers' gradients by hand, flat fused Adam, no critic weight gradients for the
  actor loss, the losses read once per ``train()``.

Models that update does not take (gSDE, non-``Box`` observations, custom networks) run stock's ``train()``.
"""

from __future__ import annotations

from typing import Any

import sb3_contrib
import torch as th
from sb3_contrib.crossq.policies import CrossQPolicy

from sb3_speedups.common.acting.off_policy import FrozenOffPolicyActor
from sb3_speedups.common.off_policy.algorithm import FastOffPolicyAlgorithm
from sb3_speedups.common.off_policy.training import split_minibatches
from sb3_speedups.common.torch_utils import num_threads_during, update_num_threads
from sb3_speedups.common.training_mode import PLAIN_SET_TRAINING_MODES
from sb3_speedups.crossq.acting import EvalRenormMlp
from sb3_speedups.crossq.update import CrossQUpdate, StockCrossQUpdate, crossq_unsupported_reason
from sb3_speedups.sac.sac import begin_soft_train, check_ent_coef

# CrossQ's policy switches its actor and critic as SAC's does: the kept switch may set their flags without the walk
PLAIN_SET_TRAINING_MODES.add(CrossQPolicy.set_training_mode)


class CrossQ(FastOffPolicyAlgorithm, sb3_contrib.CrossQ):
    """
    CrossQ, a drop-in for :class:`sb3_contrib.CrossQ` (same arguments, ``learn``, ``predict``, saved files); see
    :class:`sb3_contrib.CrossQ` for every argument not listed here.

    See :class:`~sb3_speedups.common.off_policy.algorithm.FastOffPolicyAlgorithm` for ``num_threads`` and
    ``fast_update`` (``False``: stock's ``train()``).
    """

    def _check_arguments(self, kwargs: dict[str, Any]) -> None:
        check_ent_coef(kwargs.get("ent_coef", "auto"))
        super()._check_arguments(kwargs)

    def _unsupported_reason(self) -> str | None:
        return crossq_unsupported_reason(self.policy, self.use_sde)

    def _make_updater(self, reason: str | None) -> CrossQUpdate | StockCrossQUpdate:
        if reason is not None:
            return StockCrossQUpdate(self.policy)
        ent_coef = getattr(self, "ent_coef_tensor", None)
        return CrossQUpdate(self.policy, self.log_ent_coef, self.ent_coef_optimizer, ent_coef, float(self.target_entropy))

    def _make_frozen_actor(self, reason: str | None) -> FrozenOffPolicyActor | None:
        # the actor's batch-renormalisation layers run their evaluation forward on the copies of their statistics
        return FrozenOffPolicyActor(self.actor, EvalRenormMlp.from_module) if reason is None else None

    def train(self, gradient_steps: int, batch_size: int = 64) -> None:
        """Stock's CrossQ gradient steps (the same updates), with :class:`CrossQUpdate` where the networks allow."""
        speed = self._ensure_speedups()
        updater = speed.updater
        if isinstance(updater, StockCrossQUpdate) or gradient_steps <= 0:
            return super().train(gradient_steps, batch_size)
        losses = begin_soft_train(self)
        counts = updater.counts()
        # the critics' joint forward runs 2 * batch_size rows
        threads = update_num_threads(2 * batch_size * speed.largest_linear, self.num_threads, self.device)
        # a step all by hand needs no autograd: without its dispatch every op is cheaper
        with num_threads_during(threads), th.inference_mode(updater.by_hand):
            for data in split_minibatches(self, gradient_steps, batch_size):
                self._n_updates += 1
                updater.step(data, self.gamma, self._n_updates % self.policy_delay == 0, counts, losses)
        counts.set_training(False)  # as stock's steps leave them (set_bn_training_mode(False))
        losses.record(self.logger, self._n_updates, delayed_actor=True)
        return None
