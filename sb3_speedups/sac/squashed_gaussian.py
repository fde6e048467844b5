"""
SAC's action head: a Gaussian with a state-dependent ``log_std`` (clamped to ``[-20, 2]``), sampled with the
reparametrisation trick and squashed by tanh (SB3's ``SquashedDiagGaussianDistribution``), forward and hand-derived
backward. The forward runs the operations of SB3 and ``torch.distributions.Normal`` (so the sampled actions and log
probabilities equal stock's for the same noise); the gradients are derived in docs/maths.md, "SAC actor".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch as th

#: SB3's bounds on the log standard deviation (``stable_baselines3.sac.policies.LOG_STD_MIN/MAX``)
LOG_STD_MIN, LOG_STD_MAX = -20.0, 2.0
#: SB3's ``SquashedDiagGaussianDistribution.epsilon``
SQUASH_EPSILON = 1e-6
_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass
class SquashedSample:
    """One forward's kept values ``[n, action_dim]`` (``log_prob`` ``[n, 1]``)."""

    #: the clamped log standard deviation's input (for the clamp's gradient mask)
    raw_log_std: th.Tensor
    #: the standard normal noise
    noise: th.Tensor
    std: th.Tensor
    actions: th.Tensor
    #: ``1 - actions ** 2``
    slope: th.Tensor
    #: ``1 - actions ** 2 + epsilon``
    slope_eps: th.Tensor
    log_prob: th.Tensor


def sample_squashed(out: th.Tensor, noise: th.Tensor) -> SquashedSample:
    """
    :param out: the actor's output ``[n, 2 * action_dim]``: the means, then the unclamped log standard deviations
    :param noise: standard normal noise ``[n, action_dim]`` (drawn by the caller in stock's order)
    :return: the squashed actions and their log probabilities, as SB3's ``Actor.action_log_prob``
    """
    k = noise.shape[1]
    mean, raw = out[:, :k], out[:, k:]
    log_std = th.clamp(raw, LOG_STD_MIN, LOG_STD_MAX)
    std = log_std.exp()  # stock multiplies this by ones: exact, so skipped
    gaussian = mean + noise * std
    actions = th.tanh(gaussian)
    log_prob = -((gaussian - mean) ** 2) / (2 * std**2) - std.log() - _LOG_SQRT_2PI
    log_prob = log_prob.sum(dim=1)
    slope = 1 - actions**2
    slope_eps = slope + SQUASH_EPSILON
    log_prob -= th.sum(th.log(slope_eps), dim=1)
    return SquashedSample(raw, noise, std, actions, slope, slope_eps, log_prob.unsqueeze(1))


def squashed_backward(sample: SquashedSample, rows: int, d_actions: th.Tensor, d_log_prob: th.Tensor) -> th.Tensor:
    """
    :param sample: the forward's values
    :param rows: back-propagate the first ``rows`` rows only
    :param d_actions: the loss's gradient with respect to the (squashed) actions through everything but the log
        probability ``[rows, action_dim]`` (overwritten)
    :param d_log_prob: the loss's gradient with respect to each row's log probability (a scalar tensor: SAC's
        ``ent_coef / batch_size``)
    :return: the gradient of the actor's output ``[rows, 2 * action_dim]``
    """
    actions, slope = sample.actions[:rows], sample.slope[:rows]
    # log p = N(u; mean, std) - sum log(1 - tanh(u)^2 + eps), u = mean + noise * std
    d_actions.addcmul_(th.div(actions, sample.slope_eps[:rows]), d_log_prob, value=2.0)  # the squash correction
    d_gaussian = d_actions.mul_(slope)
    d_log_std = d_gaussian * sample.noise[:rows] * sample.std[:rows] - d_log_prob
    raw = sample.raw_log_std[:rows]
    d_log_std.mul_((raw >= LOG_STD_MIN) & (raw <= LOG_STD_MAX))
    return th.cat([d_gaussian, d_log_std], dim=1)
