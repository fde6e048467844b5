"""Fast drop-in DDPG."""

from sb3_speedups.ddpg.ddpg import DDPG

__all__ = ["DDPG"]
