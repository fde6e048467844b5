"""QR-DQN (sb3-contrib's) on our DQN's Q-learning engine."""

from sb3_speedups.qrdqn.qrdqn import QRDQN

__all__ = ["QRDQN"]
