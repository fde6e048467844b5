"""
TQC as in sb3-contrib, faster. TQC is SAC with distributional critics, and ours runs our SAC's engine
(:class:`~sb3_speedups.sac.sac.SACTraining`): the same sampling ahead, frozen actor, squashed Gaussian actor and
entropy coefficient by hand, flat buffers and fused Adam. Only the critics differ
(:class:`~sb3_speedups.tqc.quantile_loss.TruncatedQuantileLoss`):

- the ``n_critics`` critics of ``n_quantiles`` outputs run as one batched product per layer;
- the truncated mixture of the target quantiles is stock's (sorted, the top ones dropped);
- the quantile Huber loss and its gradient are computed by hand in kept buffers (stock's autograd runs about twice
  as many passes over the ``[batch, critics, quantiles, targets]`` pairs), and the actor loss needs no critic weight
  gradients.

What SAC's hand-derived update does not take (gSDE, images, custom policies) runs SAC's autograd update with TQC's
losses.
"""

from __future__ import annotations

import sb3_contrib
from sb3_contrib.tqc.policies import TQCPolicy

from sb3_speedups.common.training_mode import PLAIN_SET_TRAINING_MODES
from sb3_speedups.sac.critic_loss import SoftCriticLoss
from sb3_speedups.sac.sac import SACTraining
from sb3_speedups.tqc.quantile_loss import TruncatedQuantileLoss

# TQC's policy switches its actor and critic as SAC's does: the kept switch may set their flags without the walk
PLAIN_SET_TRAINING_MODES.add(TQCPolicy.set_training_mode)


class TQC(SACTraining, sb3_contrib.TQC):
    """
    Truncated Quantile Critics, a drop-in for :class:`sb3_contrib.TQC` (same arguments, ``learn``, ``predict``, saved
    files); see :class:`sb3_contrib.TQC` for every argument not listed here.

    See :class:`~sb3_speedups.common.off_policy.algorithm.FastOffPolicyAlgorithm` for ``num_threads`` and
    ``fast_update``.
    """

    def _critic_loss(self) -> SoftCriticLoss:
        critic = self.policy.critic
        n_quantiles = critic.quantiles_total // critic.n_critics
        return TruncatedQuantileLoss(critic.n_critics, n_quantiles, self.top_quantiles_to_drop_per_net)
