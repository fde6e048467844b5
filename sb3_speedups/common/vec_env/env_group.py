"""
Stepping a group of envs into shared arrays with SB3's ``DummyVecEnv`` semantics.

The same code runs in the worker processes and, for the envs kept in the main process, in the main process,
so both paths give identical results. Observations, rewards and dones go straight into the shared arrays; only
the infos that carry something beyond ``TimeLimit.truncated=False`` are returned (and pickled by workers).
"""

from __future__ import annotations

import operator
import traceback
from collections.abc import Callable, Iterable, Sequence
from copy import deepcopy
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from stable_baselines3.common.env_util import is_wrapped
from stable_baselines3.common.vec_env.patch_gym import _patch_env
from stable_baselines3.common.vec_env.util import obs_space_info

from sb3_speedups.common.vec_env.shared_memory import ArraySpec

# (env index, info, reset info or None): the infos a step produced beyond the common {"TimeLimit.truncated": False}
InfoRecord = tuple[int, dict[str, Any], "dict[str, Any] | None"]

# pickled, or sent as text when the exception itself cannot be pickled: (exception or None, "Type: message", traceback)
ErrorRecord = tuple["BaseException | None", str, str]


def obs_keys(observation_space: spaces.Space) -> list[tuple[Any, str]]:
    """
    :param observation_space: the env's observation space
    :return: ``(key, shared array name)`` per observation part (key ``None`` for non-Dict/Tuple spaces)
    """
    keys, _, _ = obs_space_info(observation_space)
    return [(key, "obs" if key is None else f"obs/{key}") for key in keys]


def obs_specs(observation_space: spaces.Space, n_envs: int) -> list[ArraySpec]:
    """
    :param observation_space: the env's observation space
    :param n_envs: number of envs
    :return: one ``(n_envs, *shape)`` array per observation part, in the space's dtype
    """
    _, shapes, dtypes = obs_space_info(observation_space)
    return [ArraySpec(name, (n_envs, *shapes[key]), np.dtype(dtypes[key]).str) for key, name in obs_keys(observation_space)]


def annotate(exc: BaseException, env_index: int, command: str, where: str) -> None:
    """
    Say in the exception which env raised it (shown under the message by Python >= 3.11).

    :param exc: the exception raised by an env
    :param env_index: the env's index in the VecEnv
    :param command: what the env was doing (``step``, ``reset``, ...)
    :param where: ``main process`` or ``worker N (pid P)``
    """
    note = f"raised by env {env_index} during {command} in the {where}"
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    try:
        exc.sb3_env_index = env_index  # type: ignore[attr-defined]
    except AttributeError:  # pragma: no cover  (exceptions with __slots__)
        pass


def error_record(exc: BaseException) -> ErrorRecord:
    """
    :param exc: an exception caught in a worker
    :return: what the main process needs to re-raise it with the worker's traceback text
    """
    import pickle

    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    summary = f"{type(exc).__name__}: {exc}"
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        return None, summary, text
    return exc, summary, text


# Immutable value types: an info made of these only needs a shallow copy (MuJoCo envs return such infos every step).
_PLAIN_TYPES = frozenset(
    {bool, int, float, complex, str, bytes, type(None)} | {np.dtype(code).type for code in "?bBhHiIlLqQefdgFD"}
)


def detach_info(info: dict[str, Any]) -> dict[str, Any]:
    """
    A copy of ``info`` that shares nothing mutable with the env (what ``DummyVecEnv``'s deepcopy guarantees),
    deep-copying only the values that need it.

    :param info: an info dict returned by an env
    :return: the copy
    """
    plain = _PLAIN_TYPES
    if all(type(value) in plain for value in info.values()):
        return info.copy()
    return {key: value if type(value) in plain else deepcopy(value) for key, value in info.items()}


def make_envs(env_fns: Sequence[Callable[[], gym.Env]], first: int, where: str) -> list[gym.Env]:
    """
    :param env_fns: functions that each create one env
    :param first: VecEnv index of the first env, for error messages
    :param where: ``main process``, ``worker N (pid P)``, ..., for error messages
    :return: the envs, patched to the gymnasium API (those made before an error are closed)
    """
    envs: list[gym.Env] = []
    try:
        for env_fn in env_fns:
            envs.append(_patch_env(env_fn()))
    except Exception as exc:
        annotate(exc, first + len(envs), "creation", where)
        for env in envs:
            env.close()
        raise
    return envs


def resolve_indices(indices: Iterable[Any], n_envs: int) -> list[int]:
    """
    :param indices: VecEnv indices, read as list indexing reads them (``-1`` is the last env), as ``DummyVecEnv`` does
    :param n_envs: number of envs
    :return: the indices, each in ``[0, n_envs)``, in the given order (repeats kept)
    """
    resolved = []
    for index in indices:
        i = operator.index(index)
        if not -n_envs <= i < n_envs:
            raise IndexError(f"env index {i} out of range for a VecEnv of {n_envs} envs")
        resolved.append(i % n_envs)
    return resolved


# The VecEnv commands other than step and reset, run on some envs of a group: name -> (envs, arguments) -> results.
ENV_COMMANDS: dict[str, Callable[[Sequence[gym.Env], tuple[Any, ...]], list[Any]]] = {
    "get_attr": lambda envs, args: [env.get_wrapper_attr(args[0]) for env in envs],
    "set_attr": lambda envs, args: [setattr(env, args[0], args[1]) for env in envs],  # type: ignore[func-returns-value]
    "env_method": lambda envs, args: [env.get_wrapper_attr(args[0])(*args[1], **args[2]) for env in envs],
    "is_wrapped": lambda envs, args: [is_wrapped(env, args[0]) for env in envs],
    "get_images": lambda envs, args: [env.render() for env in envs],
}


class EnvGroup:
    """
    The envs one process steps, writing their results into the shared arrays.

    :param envs: the envs (already patched to the gymnasium API)
    :param first: VecEnv index of ``envs[0]``; the others follow
    :param obs_arrays: ``(key, array)`` per observation part, each ``(n_envs, *shape)``
    :param rewards: ``(n_envs,)`` float32 array
    :param dones: ``(n_envs,)`` bool array
    :param where: ``main process`` or ``worker N (pid P)``, for error messages
    :param index_offset: added to an env's row in error messages: its VecEnv index where the arrays hold only
        this group's rows (``first=0``)
    """

    def __init__(
        self,
        envs: Sequence[gym.Env],
        first: int,
        obs_arrays: list[tuple[Any, np.ndarray]],
        rewards: np.ndarray,
        dones: np.ndarray,
        where: str,
        index_offset: int = 0,
    ) -> None:
        self.envs = list(envs)
        self.first = first
        self.stop = first + len(self.envs)
        self.rewards = rewards
        self.dones = dones
        self.where = where
        self.index_offset = index_offset
        self._save_obs = self._obs_writer(obs_arrays)

    @staticmethod
    def _obs_writer(obs_arrays: list[tuple[Any, np.ndarray]]) -> Callable[[int, Any], None]:
        if len(obs_arrays) == 1 and obs_arrays[0][0] is None:
            array = obs_arrays[0][1]

            def save_one(index: int, obs: Any) -> None:
                array[index] = obs

            return save_one

        def save_parts(index: int, obs: Any) -> None:
            for key, part in obs_arrays:
                part[index] = obs[key]

        return save_parts

    def step(self, actions: Any, active: np.ndarray | None) -> list[InfoRecord]:
        """
        Step every env of the group (or those flagged in ``active``), resetting finished ones as SB3 does.

        :param actions: indexable by VecEnv index (``actions[i]`` goes to env ``i``)
        :param active: ``(n_envs,)`` bool flags of the envs to step, or ``None`` for all
        :return: the infos that are not just ``{"TimeLimit.truncated": False}``
        """
        records: list[InfoRecord] = []
        rewards, dones, save_obs = self.rewards, self.dones, self._save_obs
        index = self.first
        try:
            for index, env in enumerate(self.envs, start=self.first):
                if active is not None and not active[index]:
                    continue
                obs, rewards[index], terminated, truncated, info = env.step(actions[index])
                done = terminated or truncated
                dones[index] = done
                if done or info or type(truncated) is not bool:
                    info["TimeLimit.truncated"] = truncated and not terminated
                    if done:
                        info["terminal_observation"] = obs
                        obs, reset_info = env.reset()
                        records.append((index, info, reset_info))
                    else:
                        records.append((index, info, None))
                save_obs(index, obs)
        except Exception as exc:
            annotate(exc, index + self.index_offset, "step", self.where)
            raise
        return records

    def reset(self, seeds: Sequence[int | None], options: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        """
        Reset every env of the group.

        :param seeds: one seed per env of the group
        :param options: one options dict per env of the group (empty: no options)
        :return: the reset infos
        """
        reset_infos = []
        index = self.first
        try:
            for index, env, seed, opts in zip(range(self.first, self.stop), self.envs, seeds, options, strict=True):
                maybe_options = {"options": opts} if opts else {}
                obs, reset_info = env.reset(seed=seed, **maybe_options)
                self._save_obs(index, obs)
                reset_infos.append(reset_info)
        except Exception as exc:
            annotate(exc, index + self.index_offset, "reset", self.where)
            raise
        return reset_infos

    def targets(self, indices: Sequence[int]) -> list[gym.Env]:
        """
        :param indices: VecEnv indices inside this group
        :return: the envs
        """
        return [self.envs[i - self.first] for i in indices]

    def close(self) -> None:
        """Close every env of the group."""
        for env in self.envs:
            env.close()
