"""Fast drop-in SAC."""

from sb3_speedups.sac.sac import SAC

__all__ = ["SAC"]
