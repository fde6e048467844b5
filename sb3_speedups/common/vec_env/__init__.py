"""Vectorised environments: the batched shared-memory subprocess VecEnv and adapters for other fast vector envs."""

from sb3_speedups.common.vec_env.adapters import EnvPoolVecEnv, GymVectorVecEnv
from sb3_speedups.common.vec_env.batched_subproc import BatchedSubprocVecEnv
from sb3_speedups.common.vec_env.pool import RemoteTraceback, WorkerDiedError

__all__ = ["BatchedSubprocVecEnv", "EnvPoolVecEnv", "GymVectorVecEnv", "RemoteTraceback", "WorkerDiedError"]
