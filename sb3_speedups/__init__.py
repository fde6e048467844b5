"""sb3_speedups: faster drop-in Stable-Baselines3 algorithms with the same learning curves."""

import sb3_speedups.envs  # noqa: F401  (registers CartPoleNoVel-v1 & co.)
from sb3_speedups.common.env_util import make_vec_env
from sb3_speedups.common.vec_env import BatchedSubprocVecEnv

__version__ = "0.1.0"

__all__ = ["BatchedSubprocVecEnv", "__version__", "make_vec_env"]
