"""
The Ray actor of :class:`~sb3_speedups.common.vec_env.ray_vec_env.RayVecEnv`: it holds a run of consecutive envs
and steps them in turn with the same :class:`EnvGroup` code as BatchedSubprocVecEnv's workers, into arrays of its
own that it returns with the step's infos. No Ray import here: the VecEnv wraps the class with ``ray.remote``.

Every method returns ``(True, result)`` or ``(False, error record)``, so an env's exception reaches the training
process with its own type, its env index and the actor's traceback text (as from a BatchedSubprocVecEnv worker).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Sequence
from typing import Any

import gymnasium as gym
import numpy as np

from sb3_speedups.common.vec_env.env_group import (
    ENV_COMMANDS,
    EnvGroup,
    ErrorRecord,
    error_record,
    make_envs,
    obs_keys,
    obs_specs,
)
from sb3_speedups.common.vec_env.info_codec import InfoEncoder

Reply = tuple[bool, Any]
# A step's results: observation parts (in ``obs_keys`` order), rewards, dones, encoded info records (b"": none)
StepResult = tuple[list[np.ndarray], np.ndarray, np.ndarray, bytes]


def _reply(call: Callable[[], Any]) -> Reply:
    try:
        return True, call()
    except Exception as exc:
        record: ErrorRecord = error_record(exc)
        return False, record


class EnvActor:
    """
    :param index: actor index in its VecEnv
    :param first: VecEnv index of this actor's first env
    :param env_fns: functions that each create one env
    """

    def __init__(self, index: int, first: int, env_fns: Sequence[Callable[[], gym.Env]]) -> None:
        self.index = index
        self.first = first
        self.env_fns = list(env_fns)
        self.where = f"Ray actor {index} (host {socket.gethostname()}, pid {os.getpid()})"
        self.envs: list[gym.Env] = []
        self.group: EnvGroup | None = None
        self.obs_parts: list[np.ndarray] = []
        self.info_encoder = InfoEncoder()

    def pid(self) -> int:
        """:return: the process id of this actor (for fault tests)"""
        return os.getpid()

    def start(self) -> Reply:
        """Create the envs; reply ``(observation space, action space, where, Ray node id)``."""
        return _reply(self._start)

    def _start(self) -> tuple[gym.spaces.Space, gym.spaces.Space, str, str]:
        import ray  # present wherever this actor runs

        self.envs = make_envs(self.env_fns, self.first, self.where)
        self.env_fns = []
        observation_space = self.envs[0].observation_space
        n_envs = len(self.envs)
        arrays = {spec.name: np.zeros(spec.shape, dtype=spec.dtype) for spec in obs_specs(observation_space, n_envs)}
        obs_arrays = [(key, arrays[name]) for key, name in obs_keys(observation_space)]
        self.obs_parts = [array for _, array in obs_arrays]
        rewards, dones = np.zeros(n_envs, dtype=np.float32), np.zeros(n_envs, dtype=bool)
        self.group = EnvGroup(self.envs, 0, obs_arrays, rewards, dones, self.where, index_offset=self.first)
        return observation_space, self.envs[0].action_space, self.where, ray.get_runtime_context().get_node_id()

    def step(self, actions: Any) -> Reply:
        """:param actions: one action per env of this actor; reply a :data:`StepResult`"""
        return _reply(lambda: self._step(actions))

    def _step(self, actions: Any) -> StepResult:
        group = self.group
        assert group is not None
        records = group.step(actions, None)
        # Ray serialises the reply as this method returns, before the next step can write into these arrays.
        return self.obs_parts, group.rewards, group.dones, self.info_encoder.encode(records) if records else b""

    def reset(self, seeds: list[int | None], options: list[dict[str, Any]]) -> Reply:
        """Reset every env with its seed and options; reply ``(observation parts, reset infos)``."""
        return _reply(lambda: self._reset(seeds, options))

    def _reset(self, seeds: list[int | None], options: list[dict[str, Any]]) -> tuple[list[np.ndarray], list[dict[str, Any]]]:
        assert self.group is not None
        reset_infos = self.group.reset(seeds, options)
        return self.obs_parts, reset_infos

    def command(self, name: str, args: tuple[Any, ...], rows: list[int]) -> Reply:
        """Run the :data:`ENV_COMMANDS` command ``name`` on the envs ``rows`` (0: this actor's first env)."""
        return _reply(lambda: ENV_COMMANDS[name]([self.envs[row] for row in rows], args))

    def close(self) -> Reply:
        """Close every env (all are tried; the first error is replied)."""
        envs, self.envs = self.envs, []
        error: Exception | None = None
        for env in envs:
            try:
                env.close()
            except Exception as exc:  # closing goes on for the other envs
                error = error or exc
        if error is not None:
            return False, error_record(error)
        return True, None
