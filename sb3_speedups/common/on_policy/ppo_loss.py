"""
PPO's loss as SB3 computes it, written once for every autograd user (PPO's autograd update, RecurrentPPO's
training), with one layout of the per-minibatch statistics that PPO's hand-derived update
(:class:`~sb3_speedups.ppo.update.HandDerivedPPOUpdate`) writes too:

    ratio = exp(log_prob - old_log_prob)
    neg_pg = mean(min(A * ratio, A * clip(ratio, 1 - clip_range, 1 + clip_range)))
    V' = V, or old_V + clip(V - old_V, -clip_range_vf, clip_range_vf)
    value_loss = mean((returns - V')^2)
    entropy_loss = -mean(entropy)  (-mean(-log_prob) for distributions without an entropy)
    loss = -neg_pg + ent_coef * entropy_loss + vf_coef * value_loss

The statistics stay tensors (no host sync per minibatch); :func:`record_train_stats` logs what stock SB3 logs from
all of a ``train()``'s rows at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
import torch.nn.functional as F
from stable_baselines3.common.utils import explained_variance

from sb3_speedups.common.training_mode import set_training_mode

if TYPE_CHECKING:
    import sb3_contrib
    import stable_baselines3

    PPOModel = stable_baselines3.PPO | sb3_contrib.RecurrentPPO

#: per-minibatch statistics, in the order of a stats row: ``policy_gradient_loss`` is stored negated (``mean(min)``),
#: and SB3's ``approx_kl = mean(ratio - 1 - log_ratio)`` as ``mean(ratio)`` and ``mean(log_ratio)`` (see :func:`approx_kl`)
STATS = ("neg_policy_gradient_loss", "clip_fraction", "ratio", "log_ratio", "value_loss", "entropy_loss")
NEG_PG, CLIP_FRACTION, RATIO, LOG_RATIO, VALUE_LOSS, ENTROPY_LOSS = range(len(STATS))


def approx_kl(stats: Any) -> Any:
    """:return: SB3's approximate KL divergence from stats rows (numpy array or tensor, last dimension :data:`STATS`)"""
    return stats[..., RATIO] - 1.0 - stats[..., LOG_RATIO]


@dataclass
class PPOLossConfig:
    """The loss's coefficients for one ``train()`` call (schedules already evaluated)."""

    clip_range: float
    clip_range_vf: float | None
    ent_coef: float
    vf_coef: float
    max_grad_norm: float


def start_train(model: PPOModel) -> PPOLossConfig:
    """
    What every PPO ``train()`` does first, as SB3's: training mode on, the learning rate of this progress set.

    :param model: the PPO model
    :return: the loss's coefficients at the current progress (clip-range schedules evaluated)
    """
    set_training_mode(model, True)
    model._update_learning_rate(model.policy.optimizer)
    progress = model._current_progress_remaining
    vf = model.clip_range_vf
    return PPOLossConfig(
        float(model.clip_range(progress)),  # type: ignore[operator]
        None if vf is None else float(vf(progress)),  # type: ignore[operator]
        float(model.ent_coef),
        float(model.vf_coef),
        float(model.max_grad_norm),
    )


def ppo_loss(
    log_prob: th.Tensor,
    entropy: th.Tensor | None,
    values: th.Tensor,
    old_log_prob: th.Tensor,
    advantages: th.Tensor,
    old_values: th.Tensor,
    returns: th.Tensor,
    cfg: PPOLossConfig,
    mean: Callable[[th.Tensor], th.Tensor] = th.mean,
    value_loss: Callable[[th.Tensor, th.Tensor], th.Tensor] = F.mse_loss,
) -> tuple[th.Tensor, th.Tensor]:
    """
    The loss of the module docstring, through autograd.

    :param log_prob: log-probabilities of the actions under the current policy ``[n]``
    :param entropy: the current policy's entropies ``[n]``, or ``None``
    :param values: the current values ``[n]``
    :param old_log_prob: the rollout's log-probabilities
    :param advantages: the advantages (already normalised where asked)
    :param old_values: the rollout's values
    :param returns: the returns
    :param cfg: coefficients
    :param mean: the mean over samples (a masked mean for padded sequences)
    :param value_loss: ``(returns, V') -> mean squared error``
    :return: the loss and its statistics row (:data:`STATS`), detached
    """
    log_ratio = log_prob - old_log_prob
    ratio = th.exp(log_ratio)
    s1 = advantages * ratio
    s2 = advantages * th.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range)
    neg_pg = mean(th.min(s1, s2))
    if cfg.clip_range_vf is None:
        values_pred = values
    else:
        values_pred = old_values + th.clamp(values - old_values, -cfg.clip_range_vf, cfg.clip_range_vf)
    v_loss = value_loss(returns, values_pred)
    entropy_loss = -mean(-log_prob if entropy is None else entropy)
    loss = -neg_pg + cfg.ent_coef * entropy_loss + cfg.vf_coef * v_loss
    with th.no_grad():
        clip_fraction = mean((th.abs(ratio - 1) > cfg.clip_range).float())
        stats = th.stack([neg_pg, clip_fraction, mean(ratio), mean(log_ratio), v_loss, entropy_loss]).detach()
    return loss, stats


def kl_stops(model: PPOModel, row: th.Tensor, epoch: int) -> bool:
    """
    :param model: the PPO model (its ``target_kl`` and ``verbose`` are read)
    :param row: the stats row of the minibatch just computed
    :param epoch: the current epoch (for the message)
    :return: whether ``target_kl`` stops the epochs after this minibatch (as stock SB3; one host sync)
    """
    target_kl = model.target_kl
    if target_kl is None:
        return False
    kl = float(approx_kl(row.double()))
    if kl <= 1.5 * target_kl:
        return False
    if model.verbose >= 1:
        print(f"Early stopping at step {epoch} due to reaching max kl: {kl:.2f}")
    return True


def record_train_stats(model: PPOModel, stats: th.Tensor, last_epoch_start: int, cfg: PPOLossConfig) -> None:
    """
    Record what stock SB3 records after ``train()`` (one host sync for all of it).

    :param model: the PPO model (its logger, rollout buffer, policy and ``_n_updates``)
    :param stats: the ``train()``'s stats rows, one per minibatch update
    :param last_epoch_start: the index of the last epoch's first row (``approx_kl`` is its mean)
    :param cfg: the coefficients the ``train()`` used
    """
    table = stats.cpu().numpy().astype(np.float64)
    means = table.mean(axis=0)
    last = table[-1]
    buffer = model.rollout_buffer
    logger = model.logger
    logger.record("train/entropy_loss", float(means[ENTROPY_LOSS]))
    logger.record("train/policy_gradient_loss", float(-means[NEG_PG]))
    logger.record("train/value_loss", float(means[VALUE_LOSS]))
    logger.record("train/approx_kl", float(approx_kl(table[last_epoch_start:]).mean()))
    logger.record("train/clip_fraction", float(means[CLIP_FRACTION]))
    loss = -last[NEG_PG] + cfg.ent_coef * last[ENTROPY_LOSS] + cfg.vf_coef * last[VALUE_LOSS]
    logger.record("train/loss", float(loss))
    logger.record("train/explained_variance", float(explained_variance(buffer.values.flatten(), buffer.returns.flatten())))
    log_std = getattr(model.policy, "log_std", None)
    if log_std is not None:
        logger.record("train/std", th.exp(log_std).mean().item())
    logger.record("train/n_updates", model._n_updates, exclude="tensorboard")
    logger.record("train/clip_range", cfg.clip_range)
    if cfg.clip_range_vf is not None:
        logger.record("train/clip_range_vf", cfg.clip_range_vf)
