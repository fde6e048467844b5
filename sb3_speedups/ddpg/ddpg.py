"""
DDPG as in Stable-Baselines3, faster: as in SB3, DDPG is TD3 with one critic, no delayed policy updates and no target
policy noise, so our TD3's update runs it (:class:`sb3_speedups.TD3`). The target noise is still drawn and clipped to
zero, as stock does, so the torch RNG stays in step with stock's.
"""

from __future__ import annotations

import stable_baselines3

from sb3_speedups.td3.td3 import TD3


class DDPG(TD3, stable_baselines3.DDPG):
    """
    Deep Deterministic Policy Gradient, a drop-in for :class:`stable_baselines3.DDPG` (same arguments, ``learn``,
    ``predict``, saved files); see :class:`stable_baselines3.DDPG` for its arguments and :class:`sb3_speedups.TD3`
    for ``num_threads`` and ``fast_update``.
    """
