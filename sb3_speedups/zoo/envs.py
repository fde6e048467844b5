"""Building the (vectorised, wrapped, normalised) environments of a run from its hyperparameters."""

from __future__ import annotations

import contextlib
import difflib
import io
import importlib
import importlib.util
from pathlib import Path
from typing import Any

import gymnasium as gym
from stable_baselines3.common.atari_wrappers import AtariWrapper
from stable_baselines3.common.preprocessing import is_image_space, is_image_space_channels_first
from stable_baselines3.common.vec_env import VecEnv, VecFrameStack, VecNormalize, VecTransposeImage, is_vecenv_wrapped

import sb3_speedups.envs  # noqa: F401  (registers CartPoleNoVel-v1 & co.)
from sb3_speedups.common.env_util import make_vec_env
from sb3_speedups.common.vec_env.adapters import VectorAdapter
from sb3_speedups.common.vec_env.ale import AleVecEnv
from sb3_speedups.errors import UserError, UserValueError
from sb3_speedups.registry import import_object
from sb3_speedups.zoo.hyperparams import Hyperparams

# --vec-env name -> import path of the VecEnv class
VEC_ENV_CLASSES: dict[str, str] = {
    "dummy": "stable_baselines3.common.vec_env:DummyVecEnv",
    "subproc": "stable_baselines3.common.vec_env:SubprocVecEnv",
    "batched": "sb3_speedups.common.vec_env:BatchedSubprocVecEnv",
    "envpool": "sb3_speedups.common.vec_env.adapters:EnvPoolVecEnv",
    "gym_vector": "sb3_speedups.common.vec_env.adapters:GymVectorVecEnv",
    "ale": "sb3_speedups.common.vec_env.ale:AleVecEnv",  # needs the extra sb3-speedups[atari]
    "ray": "sb3_speedups.common.vec_env.ray_vec_env:RayVecEnv",  # needs the extra sb3-speedups[ray]
}


# Packages that register their envs when imported (the RL Zoo imports them too), and how to install each.
ENV_PACKAGES: dict[str, str] = {
    "ale_py": "pip install 'sb3-speedups[atari]'",
    "gymnasium_robotics": "pip install gymnasium-robotics",
}


def import_env_packages(env_id: str) -> None:
    """
    Import the installed :data:`ENV_PACKAGES` when ``env_id`` is not registered yet (also in fresh worker processes).

    :param env_id: gymnasium id
    """
    if env_id in gym.registry:
        return
    for module in ENV_PACKAGES:
        if importlib.util.find_spec(module) is not None:
            # imported unasked: a notice printed at import (gymnasium-robotics 1.4.2 prints one) would break one-line errors
            with contextlib.redirect_stderr(io.StringIO()):
                gym.register_envs(importlib.import_module(module))


def _install_hint(env_id: str) -> str | None:
    """:return: how to install the package of an env id of a known family that is not installed, else ``None``"""
    if (env_id.startswith("ALE/") or "NoFrameskip" in env_id) and importlib.util.find_spec("ale_py") is None:
        return f"Atari envs need ale-py: {ENV_PACKAGES['ale_py']}"
    return None


def check_env_id(env_id: str) -> None:
    """
    Fail with close matches when ``env_id`` is not registered (``module:EnvId`` imports the module first).

    :param env_id: gymnasium id
    """
    module, sep, name = env_id.partition(":")
    if sep:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UserError(f"cannot import {module!r} for env {env_id!r}: {exc}") from None
        env_id = name
    import_env_packages(env_id)
    if env_id in gym.registry:
        return
    close = difflib.get_close_matches(env_id, list(gym.registry), n=3, cutoff=0.6)
    hint = _install_hint(env_id) or (
        f"did you mean {', '.join(close)}?" if close else "check the name, or write module:EnvId to import its package"
    )
    raise UserError(f"unknown environment id {env_id!r}; {hint}")


def is_atari(env_id: str) -> bool:
    """:return: whether ``env_id`` is an ALE Atari env"""
    spec = gym.registry.get(env_id.partition(":")[2] or env_id)
    return spec is not None and "AtariEnv" in str(spec.entry_point)


class WrapperChain:
    """
    Picklable ``wrapper_class`` applying ``[(wrapper, kwargs), ...]`` in order (works with subprocess workers).

    :param wrappers: wrapper classes with their keyword arguments
    """

    def __init__(self, wrappers: list[tuple[Any, dict[str, Any]]]) -> None:
        self.wrappers = list(wrappers)

    def __call__(self, env: gym.Env) -> gym.Env:
        for wrapper, kwargs in self.wrappers:
            env = wrapper(env, **kwargs)
        return env


def make_single_env(env_id: str, **kwargs: Any) -> gym.Env:
    """
    ``gym.make`` after registering the package's envs and those of :data:`ENV_PACKAGES` (so that it also works in
    freshly spawned workers).

    :param env_id: gymnasium id
    :param kwargs: ``gym.make`` keyword arguments
    :return: the env
    """
    import_env_packages(env_id)
    return gym.make(env_id, **kwargs)


def vec_env_class(name: str) -> type[VecEnv]:
    """
    :param name: ``dummy``, ``subproc``, ... (``--vec-env``)
    :return: the VecEnv class
    """
    if name not in VEC_ENV_CLASSES:
        raise UserError(f"unknown --vec-env {name!r}; choose one of: {', '.join(VEC_ENV_CLASSES)}")
    return import_object(VEC_ENV_CLASSES[name])


def _maybe_transpose(env: VecEnv) -> VecEnv:
    if is_vecenv_wrapped(env, VecTransposeImage):
        return env
    obs_spaces = (
        env.observation_space.spaces.values()
        if isinstance(env.observation_space, gym.spaces.Dict)
        else [env.observation_space]
    )
    if any(is_image_space(space) and not is_image_space_channels_first(space) for space in obs_spaces):  # type: ignore[arg-type]
        return VecTransposeImage(env)
    return env


def ale_settings(env_id: str, hyperparams: Hyperparams, vec_env_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """
    ``AleVecEnv``'s arguments for the hyperparameters' ``AtariWrapper`` and ``frame_stack``, which ALE does itself.

    :param env_id: gymnasium id
    :param hyperparams: preprocessed hyperparameters
    :param vec_env_kwargs: extra ``AleVecEnv`` arguments
    :return: ``AtariWrapper``'s keyword arguments and ``n_stack`` (as ``vec_env_kwargs``), ALE's stack included
    """
    others = [wrapper.__name__ for wrapper, _ in hyperparams.env_wrappers if wrapper is not AtariWrapper]
    if others:
        raise UserValueError(f"--vec-env ale cannot apply env_wrapper {', '.join(others)} in ALE; use another --vec-env")
    if not hyperparams.env_wrappers:
        raise UserValueError(
            f"--vec-env ale does AtariWrapper's preprocessing, which {env_id}'s hyperparameters do not ask for; "
            "add env_wrapper AtariWrapper or use another --vec-env"
        )
    n_stack = int(hyperparams.frame_stack or 1)
    kwargs = dict(vec_env_kwargs or {})
    if kwargs.setdefault("n_stack", n_stack) != n_stack:
        raise UserValueError(f"frame_stack {n_stack} of the hyperparameters differs from n_stack {kwargs['n_stack']} of ALE")
    for _, wrapper_kwargs in hyperparams.env_wrappers:
        kwargs.update(wrapper_kwargs)
    return kwargs


def make_env(
    env_id: str,
    hyperparams: Hyperparams,
    n_envs: int,
    seed: int | None = None,
    monitor_dir: str | Path | None = None,
    vec_env: str = "dummy",
    eval_env: bool = False,
    normalize_stats: str | Path | None = None,
    vec_env_kwargs: dict[str, Any] | None = None,
) -> VecEnv:
    """
    The vectorised env of a run, wrapped as the RL Zoo does: env wrappers, Monitor, VecEnv wrappers, VecNormalize
    (statistics loaded from ``normalize_stats`` when given), frame stacking, image transposition.

    :param env_id: gymnasium id
    :param hyperparams: preprocessed hyperparameters
    :param n_envs: number of envs
    :param seed: base seed (env ``i`` gets ``seed + i``)
    :param monitor_dir: folder for Monitor CSV files, or ``None``
    :param vec_env: ``--vec-env`` name
    :param eval_env: evaluation env (no reward normalisation, frozen statistics)
    :param normalize_stats: a saved ``vecnormalize.pkl`` to load
    :param vec_env_kwargs: extra VecEnv constructor arguments
    :return: the env
    """
    vec_env_cls = vec_env_class(vec_env)
    # The adapters build the whole batch from the id; the others get one make_single_env per env.
    adapter = issubclass(vec_env_cls, VectorAdapter)
    # ALE stacks the frames and does AtariWrapper's work in C++: they are its arguments, not wrappers.
    ale = issubclass(vec_env_cls, AleVecEnv)
    if ale:
        vec_env_kwargs = ale_settings(env_id, hyperparams, vec_env_kwargs)
    try:
        env: VecEnv = make_vec_env(
            env_id if adapter else make_single_env,
            n_envs=n_envs,
            seed=seed,
            env_kwargs=dict(hyperparams.env_kwargs) if adapter else {"env_id": env_id, **hyperparams.env_kwargs},
            monitor_dir=None if monitor_dir is None else str(monitor_dir),
            wrapper_class=WrapperChain(hyperparams.env_wrappers) if hyperparams.env_wrappers and not ale else None,
            vec_env_cls=vec_env_cls,
            vec_env_kwargs=vec_env_kwargs,
            monitor_kwargs=hyperparams.monitor_kwargs,
        )
    except (gym.error.DependencyNotInstalled, ImportError) as exc:
        # the library's own message names the package to install
        raise UserError(f"cannot make {env_id}: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    for wrapper, kwargs in hyperparams.vec_env_wrappers:
        env = wrapper(env, **kwargs)
    if normalize_stats is not None and Path(normalize_stats).is_file():
        env = VecNormalize.load(str(normalize_stats), env)
        if eval_env:
            env.training, env.norm_reward = False, False
    elif hyperparams.normalize:
        kwargs = dict(hyperparams.normalize_kwargs)
        if eval_env:
            kwargs.update(norm_reward=False, training=False)
        env = VecNormalize(env, **kwargs)
    if hyperparams.frame_stack and not ale:
        env = VecFrameStack(env, int(hyperparams.frame_stack))
    return _maybe_transpose(env)
