"""MaskablePPO (sb3-contrib's invalid-action masking) on PPO's engine."""

from sb3_speedups.ppo_mask.buffers import FastMaskableRolloutBuffer
from sb3_speedups.ppo_mask.ppo_mask import MaskablePPO

__all__ = ["FastMaskableRolloutBuffer", "MaskablePPO"]
