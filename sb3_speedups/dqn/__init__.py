"""Fast drop-in DQN with modern replay options."""

from sb3_speedups.dqn.dqn import DQN
from sb3_speedups.dqn.policies import DuelingCnnPolicy, DuelingMlpPolicy, DuelingMultiInputPolicy, DuelingQNetwork

__all__ = ["DQN", "DuelingCnnPolicy", "DuelingMlpPolicy", "DuelingMultiInputPolicy", "DuelingQNetwork"]
