"""sb3_speedups: faster drop-in Stable-Baselines3 algorithms with the same learning curves."""

import sb3_speedups.envs  # noqa: F401  (registers CartPoleNoVel-v1 & co.)

__version__ = "0.1.0"

__all__ = ["__version__"]
