"""
The maths of SB3's action distributions on plain tensors, without ``torch.distributions`` objects.

Each head turns the action net's output (logits or means) into samples, log-probabilities and entropies, three
ways: ``sample`` for collection (drawing from torch's RNG exactly as ``torch.distributions`` does, so a rollout
matches stock SB3 for the same seed), ``log_prob_entropy`` for autograd, and ``forward``/``backward`` for the
hand-derived PPO update (no autograd graph). See ``docs/maths.md``, "Action heads", for the gradients ``backward``
writes, the autograd reference each must equal and the tests that check it.
"""

from __future__ import annotations

from gymnasium import spaces
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    Distribution,
    MultiCategoricalDistribution,
)

from sb3_speedups.common.nn.heads.base import ActionHead, HeadWorkspace, sample_one_per_row
from sb3_speedups.common.nn.heads.bernoulli import BernoulliHead, BernoulliWorkspace
from sb3_speedups.common.nn.heads.categorical import CategoricalHead, CategoricalWorkspace
from sb3_speedups.common.nn.heads.gaussian import DiagGaussianHead, GaussianWorkspace

__all__ = [
    "ActionHead",
    "BernoulliHead",
    "BernoulliWorkspace",
    "CategoricalHead",
    "CategoricalWorkspace",
    "DiagGaussianHead",
    "GaussianWorkspace",
    "HeadWorkspace",
    "make_head",
    "sample_one_per_row",
]


def make_head(action_dist: Distribution, action_space: spaces.Space) -> ActionHead | None:
    """
    :param action_dist: the policy's SB3 distribution
    :param action_space: the action space
    :return: the matching head, or ``None`` for distributions without one (gSDE, squashed Gaussian, custom)
    """
    if type(action_dist) is CategoricalDistribution:
        assert isinstance(action_space, spaces.Discrete)
        return CategoricalHead([int(action_space.n)])
    if type(action_dist) is MultiCategoricalDistribution:
        return CategoricalHead([int(n) for n in action_dist.action_dims])
    if type(action_dist) is BernoulliDistribution:
        return BernoulliHead(int(action_dist.action_dims))
    if type(action_dist) is DiagGaussianDistribution:
        return DiagGaussianHead(int(action_dist.action_dim))
    return None
