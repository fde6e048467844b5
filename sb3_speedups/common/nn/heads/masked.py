"""
Invalid-action masking of the categorical heads, as sb3-contrib's ``MaskableCategorical`` does it: a masked choice's
logit becomes ``-1e8`` (``th.where(mask, logits, -1e8)``), then everything is the plain categorical's maths
(``docs/maths.md``, "Masked categorical").
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch as th
from stable_baselines3.common.distributions import Distribution

from sb3_speedups.common.nn.heads.categorical import CategoricalHead, CategoricalWorkspace

#: the logit sb3-contrib gives a masked choice (its probability is then exactly 0 in float32)
MASKED_LOGIT = -1e8
#: below this, float32 ``exp`` is exactly 0 (its smallest subnormal is ``exp(-103.3)``)
EXP_ZERO_BELOW = -110.0


def mask_logits(out: th.Tensor, masks: th.Tensor | np.ndarray) -> th.Tensor:
    """
    :param out: the action net's output ``[n, n_outputs]``
    :param masks: ``True`` (or non-zero) where a choice is allowed, any shape of ``n * n_outputs`` entries
    :return: ``out`` with the masked choices' logits replaced by :data:`MASKED_LOGIT`
    """
    allowed = th.as_tensor(masks, dtype=th.bool, device=out.device).reshape(out.shape)
    return th.where(allowed, out, th.tensor(MASKED_LOGIT, dtype=out.dtype, device=out.device))


def mask_logits_numpy(out: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """:func:`mask_logits` on a numpy output (the numpy acting executor's)."""
    allowed = np.asarray(masks, dtype=bool).reshape(out.shape)
    return np.where(allowed, out, out.dtype.type(MASKED_LOGIT))


@dataclass(slots=True, kw_only=True)
class MaskedCategoricalWorkspace(CategoricalWorkspace):
    """
    :param masked: the masked logits ``[n, n_outputs]`` of the last forward
    :param masked_logit: :data:`MASKED_LOGIT` as a 0-d tensor on the device (``th.where(..., out=)`` takes no float)
    :param underflows: where a log-probability's ``exp`` is exactly 0 ``[n, n_outputs]`` (bool)
    :param zero: 0 as a 0-d tensor on the device
    :param exp_zero_below: :data:`EXP_ZERO_BELOW` as a 0-d tensor on the device
    """

    masked: th.Tensor
    masked_logit: th.Tensor
    underflows: th.Tensor
    zero: th.Tensor
    exp_zero_below: th.Tensor


class MaskedCategoricalHead(CategoricalHead):
    """
    :class:`CategoricalHead` behind sb3-contrib's masking: the training actions carry the rollout's masks
    (``actions["masks"]``, bool ``[N, n_outputs]``), ``forward`` masks the logits into its workspace and runs the
    plain head on them. ``backward`` needs nothing more: a masked choice has ``p = 0`` exactly and is never the taken
    action, so the plain gradient there is 0, as autograd's through ``th.where``.
    """

    def workspace(self, n: int, device: th.device) -> MaskedCategoricalWorkspace:
        plain = super().workspace(n, device)
        return MaskedCategoricalWorkspace(
            masked=th.empty(n, self.n_outputs, device=device),
            masked_logit=th.tensor(MASKED_LOGIT, device=device),
            underflows=th.empty(n, self.n_outputs, dtype=th.bool, device=device),
            zero=th.tensor(0.0, device=device),
            exp_zero_below=th.tensor(EXP_ZERO_BELOW, device=device),
            **{f.name: getattr(plain, f.name) for f in fields(plain)},
        )

    def forward(
        self,
        ws: CategoricalWorkspace,
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        assert isinstance(ws, MaskedCategoricalWorkspace)
        th.where(actions["masks"], out, ws.masked_logit, out=ws.masked)
        super().forward(ws, ws.masked, actions, log_std, log_prob, neg_entropy)

    def _exp(self, ws: CategoricalWorkspace, logp_all: th.Tensor, p: th.Tensor) -> None:
        # The masked choices' log-probabilities (about -1e8) send the CPU's vectorised exp into its slow underflow
        # path, many times the cost of the rest; their exp is exactly 0, so it is taken of 0 and then set to 0.
        assert isinstance(ws, MaskedCategoricalWorkspace)
        th.lt(logp_all, ws.exp_zero_below, out=ws.underflows)
        th.where(ws.underflows, ws.zero, logp_all, out=p)
        th.exp(p, out=p)
        th.where(ws.underflows, ws.zero, p, out=p)

    def log_prob_entropy(self, out: th.Tensor, actions: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        raise NotImplementedError("masked heads take their masks with the training actions (forward)")


def make_masked_head(action_dist: Distribution) -> MaskedCategoricalHead | None:
    """
    :param action_dist: a policy's sb3-contrib maskable distribution
    :return: the matching head (``MultiBinary`` is sb3-contrib's two-choice multi-categorical), or ``None``
    """
    # imported here: the acting code imports this module for mask_logits, also where sb3-contrib is not needed
    from sb3_contrib.common.maskable.distributions import (
        MaskableBernoulliDistribution,
        MaskableCategoricalDistribution,
        MaskableMultiCategoricalDistribution,
    )

    if type(action_dist) is MaskableCategoricalDistribution:
        return MaskedCategoricalHead([int(action_dist.action_dim)])
    if type(action_dist) in (MaskableMultiCategoricalDistribution, MaskableBernoulliDistribution):
        assert isinstance(action_dist, MaskableMultiCategoricalDistribution)
        return MaskedCategoricalHead([int(n) for n in action_dist.action_dims])
    return None
