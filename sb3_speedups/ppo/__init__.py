"""Fast drop-in PPO."""

from sb3_speedups.ppo.ppo import PPO

__all__ = ["PPO"]
