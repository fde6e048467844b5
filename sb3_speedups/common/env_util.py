"""``make_vec_env`` and ``make_atari_env`` that also build :class:`BatchedSubprocVecEnv` and the vector-env adapters."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import gymnasium as gym
from stable_baselines3.common.atari_wrappers import AtariWrapper
from stable_baselines3.common.env_util import make_vec_env as sb3_make_vec_env
from stable_baselines3.common.vec_env import SubprocVecEnv, VecEnv, VecFrameStack, VecMonitor

from sb3_speedups.common.vec_env.adapters import VectorAdapter
from sb3_speedups.common.vec_env.ale import AleVecEnv
from sb3_speedups.common.vec_env.batched_subproc import BatchedSubprocVecEnv
from sb3_speedups.errors import UserTypeError, UserValueError


def make_vec_env(
    env_id: str | Callable[..., gym.Env],
    n_envs: int = 1,
    seed: int | None = None,
    start_index: int = 0,
    monitor_dir: str | None = None,
    wrapper_class: Callable[[gym.Env], gym.Env] | None = None,
    env_kwargs: dict[str, Any] | None = None,
    vec_env_cls: type[VecEnv] | None = None,
    vec_env_kwargs: dict[str, Any] | None = None,
    monitor_kwargs: dict[str, Any] | None = None,
    wrapper_kwargs: dict[str, Any] | None = None,
    *,
    n_workers: int | None = None,
    start_method: str | None = None,
) -> VecEnv:
    """
    SB3's ``make_vec_env`` (same arguments, same envs, same seeding), which also accepts
    ``vec_env_cls=BatchedSubprocVecEnv`` and the adapters ``EnvPoolVecEnv`` / ``GymVectorVecEnv`` (these build
    the whole batch from ``env_id`` and are wrapped in a ``VecMonitor`` instead of one ``Monitor`` per env).
    ``vec_env_cls=AleVecEnv`` gives what ``wrapper_class=AtariWrapper`` gives (see :func:`make_atari_env`).

    :param n_workers: worker processes of ``BatchedSubprocVecEnv``
    :param start_method: start method of ``BatchedSubprocVecEnv`` or ``SubprocVecEnv``
    :return: the VecEnv; see :func:`stable_baselines3.common.env_util.make_vec_env` for the other parameters
    """
    vec_env_kwargs = dict(vec_env_kwargs or {})
    if n_workers is not None:
        if vec_env_cls is None or not issubclass(vec_env_cls, BatchedSubprocVecEnv):
            raise UserTypeError("n_workers is an option of BatchedSubprocVecEnv; pass vec_env_cls=BatchedSubprocVecEnv")
        vec_env_kwargs["n_workers"] = n_workers
    if start_method is not None:
        if vec_env_cls is None or not issubclass(vec_env_cls, (BatchedSubprocVecEnv, SubprocVecEnv)):
            raise UserTypeError("start_method needs vec_env_cls=BatchedSubprocVecEnv or SubprocVecEnv")
        vec_env_kwargs["start_method"] = start_method
    if vec_env_cls is not None and issubclass(vec_env_cls, AleVecEnv):
        if wrapper_class not in (None, AtariWrapper):
            raise UserValueError("AleVecEnv does AtariWrapper's work in ALE; drop wrapper_class (use VecEnv wrappers)")
        return make_atari_env(
            env_id,
            n_envs,
            seed,
            start_index,
            monitor_dir,
            wrapper_kwargs,
            env_kwargs,
            vec_env_cls,
            vec_env_kwargs,
            monitor_kwargs,
        )
    if vec_env_cls is not None and issubclass(vec_env_cls, VectorAdapter):
        return _make_adapter(
            vec_env_cls, env_id, n_envs, seed, monitor_dir, wrapper_class, env_kwargs, vec_env_kwargs, monitor_kwargs
        )
    return sb3_make_vec_env(
        env_id,
        n_envs=n_envs,
        seed=seed,
        start_index=start_index,
        monitor_dir=monitor_dir,
        wrapper_class=wrapper_class,
        env_kwargs=env_kwargs,
        vec_env_cls=vec_env_cls,  # type: ignore[arg-type]
        vec_env_kwargs=vec_env_kwargs,
        monitor_kwargs=monitor_kwargs,
        wrapper_kwargs=wrapper_kwargs,
    )


def _make_adapter(
    adapter_cls: type[VectorAdapter],
    env_id: str | Callable[..., gym.Env],
    n_envs: int,
    seed: int | None,
    monitor_dir: str | None,
    wrapper_class: Callable[[gym.Env], gym.Env] | None,
    env_kwargs: dict[str, Any] | None,
    vec_env_kwargs: dict[str, Any],
    monitor_kwargs: dict[str, Any] | None,
) -> VecEnv:
    name = adapter_cls.__name__
    if not isinstance(env_id, str):
        raise UserTypeError(f"{name} builds its envs from an env id; pass env_id as a string, not a callable")
    if wrapper_class is not None:
        raise UserValueError(f"{name} runs its envs outside Python gym wrappers; drop wrapper_class (use VecEnv wrappers)")
    env = adapter_cls.from_env_id(env_id, n_envs, seed=seed, env_kwargs=env_kwargs, **vec_env_kwargs)
    env.seed(seed)
    filename = None
    if monitor_dir is not None:
        os.makedirs(monitor_dir, exist_ok=True)
        filename = os.path.join(monitor_dir, "vec")
    info_keywords = tuple((monitor_kwargs or {}).get("info_keywords", ()))
    return VecMonitor(env, filename=filename, info_keywords=info_keywords)


def make_atari_env(
    env_id: str | Callable[..., gym.Env],
    n_envs: int = 1,
    seed: int | None = None,
    start_index: int = 0,
    monitor_dir: str | None = None,
    wrapper_kwargs: dict[str, Any] | None = None,
    env_kwargs: dict[str, Any] | None = None,
    vec_env_cls: type[VecEnv] | None = None,
    vec_env_kwargs: dict[str, Any] | None = None,
    monitor_kwargs: dict[str, Any] | None = None,
    *,
    n_stack: int | None = None,
) -> VecEnv:
    """
    SB3's ``make_atari_env`` (same arguments, same envs), which also accepts our VecEnv kinds, among them
    ``vec_env_cls=AleVecEnv``: ALE's C++ vector env with ``AtariWrapper``'s preprocessing (``wrapper_kwargs`` are
    ``AtariWrapper``'s, ``vec_env_kwargs`` may set ``num_threads``).

    Frame stacking is the same whatever the VecEnv: without ``n_stack``, none (add ``VecFrameStack`` yourself, as with
    SB3's ``make_atari_env``); with ``n_stack=4``, the returned env is stacked: by ALE in C++ for ``AleVecEnv``
    (channel-first ``(4, 84, 84)``, do not add ``VecFrameStack``), by a ``VecFrameStack`` for the others.

    :param n_stack: frames per observation, or ``None`` to stack none
    :return: the VecEnv; see :func:`stable_baselines3.common.env_util.make_atari_env` for the other parameters
    """
    if vec_env_cls is not None and issubclass(vec_env_cls, AleVecEnv):
        if not isinstance(env_id, str):
            raise UserTypeError("AleVecEnv builds its envs from an env id; pass env_id as a string, not a callable")
        kwargs: dict[str, Any] = {"n_stack": 1, **(wrapper_kwargs or {}), **(vec_env_kwargs or {})}
        if n_stack is not None:
            kwargs["n_stack"] = n_stack
        if monitor_dir is not None:
            os.makedirs(monitor_dir, exist_ok=True)
            kwargs["monitor_file"] = os.path.join(monitor_dir, "vec")
        # Its own Monitor-style episodes: a VecMonitor would end one at every life loss.
        kwargs["info_keywords"] = tuple((monitor_kwargs or {}).get("info_keywords", ()))
        ale_env = vec_env_cls.from_env_id(env_id, n_envs, env_kwargs=env_kwargs, **kwargs)
        ale_env.seed(None if seed is None else seed + start_index)
        return ale_env
    env = make_vec_env(
        env_id,
        n_envs=n_envs,
        seed=seed,
        start_index=start_index,
        monitor_dir=monitor_dir,
        wrapper_class=AtariWrapper,
        env_kwargs=env_kwargs,
        vec_env_cls=vec_env_cls,
        vec_env_kwargs=vec_env_kwargs,
        monitor_kwargs=monitor_kwargs,
        wrapper_kwargs=wrapper_kwargs,
    )
    return env if n_stack is None else VecFrameStack(env, n_stack)
