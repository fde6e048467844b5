"""Fast drop-in TD3."""

from sb3_speedups.td3.td3 import TD3

__all__ = ["TD3"]
