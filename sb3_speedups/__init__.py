"""sb3_speedups: faster drop-in Stable-Baselines3 algorithms with the same learning curves."""

from typing import Any

from sb3_speedups.common.openmp import short_spin_while_torch_loads

# First, before anything loads torch: its OpenMP threads' short idle spin (common/openmp.py).
with short_spin_while_torch_loads():
    import torch  # noqa: F401

import sb3_speedups.envs  # noqa: F401  (registers CartPoleNoVel-v1 & co.)
from sb3_speedups.common.env_util import make_vec_env
from sb3_speedups.common.vec_env import BatchedSubprocVecEnv

__version__ = "0.1.0"

# Algorithms are imported on first use, so that ``import sb3_speedups`` (and ``sb3-speedups --help``) stays fast.
_LAZY = {
    "PPO": "sb3_speedups.ppo:PPO",
    "A2C": "sb3_speedups.a2c:A2C",
    "MaskablePPO": "sb3_speedups.ppo_mask:MaskablePPO",
    "DQN": "sb3_speedups.dqn:DQN",
    "QRDQN": "sb3_speedups.qrdqn:QRDQN",
    "RecurrentPPO": "sb3_speedups.ppo_recurrent:RecurrentPPO",
    "SAC": "sb3_speedups.sac:SAC",
    "TD3": "sb3_speedups.td3:TD3",
    "DDPG": "sb3_speedups.ddpg:DDPG",
    "TQC": "sb3_speedups.tqc:TQC",
    "CrossQ": "sb3_speedups.crossq:CrossQ",
    "TRPO": "sb3_speedups.trpo:TRPO",
    "ARS": "sb3_speedups.ars:ARS",
}

# Needs an extra (sb3-speedups[ray]); left out of __all__ so that a star import works without it.
_OPTIONAL = {"RayVecEnv": "sb3_speedups.common.vec_env.ray_vec_env:RayVecEnv"}

__all__ = ["BatchedSubprocVecEnv", "__version__", "make_vec_env", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY or name in _OPTIONAL:
        from sb3_speedups.registry import import_object

        return import_object(_LAZY.get(name) or _OPTIONAL[name])
    raise AttributeError(f"module 'sb3_speedups' has no attribute {name!r}")
