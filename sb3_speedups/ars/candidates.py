"""
Where the ARS candidates' envs come from: a VecEnv of envs made as the training env's first env was made (its
``gym.make`` spec and the wrappers recorded in it, Monitor at its place), or the user's own factory.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, cast

import gymnasium as gym
from gymnasium.envs.registration import EnvSpec, load_env_creator
from stable_baselines3.common.monitor import Monitor
from stable_baselines3.common.vec_env import DummyVecEnv, VecEnv, VecEnvWrapper, VecMonitor, VecNormalize, is_vecenv_wrapped

from sb3_speedups.common.vec_env.batched_subproc import BatchedSubprocVecEnv
from sb3_speedups.errors import UserTypeError, UserValueError

MONITOR_ENTRY_POINT = f"{Monitor.__module__}:{Monitor.__name__}"
#: the training env's wrappers that the candidates' envs can do without: ARS applies VecNormalize's statistics itself,
#: and sums the rewards as VecMonitor does
KNOWN_VEC_WRAPPERS = (VecNormalize, VecMonitor)


@dataclass(frozen=True)
class EnvRecipe:
    """
    Makes one env as ``gym.make(spec)`` makes it with the spec's wrappers (the spec of the outermost wrapper records
    them all), without a render mode; SB3's ``Monitor`` (which records no arguments) with its defaults, writing to
    ``ars_candidate_<index>.monitor.csv`` next to the training env's Monitor file where that one writes a file in a
    ``DummyVecEnv`` (so the RL Zoo's plots see the candidates' episodes, as they see stock's on the training env).

    :param spec: the spec of the env's outermost wrapper
    :param monitor_dir: the folder of the training env's Monitor file, or ``None``
    :param index: the env's index among the candidates' envs
    """

    spec: EnvSpec
    monitor_dir: str | None = None
    index: int = 0

    def __call__(self) -> gym.Env:
        kwargs = {key: value for key, value in self.spec.kwargs.items() if key != "render_mode"}
        env = cast(gym.Env, gym.make(replace(self.spec, kwargs=kwargs, additional_wrappers=())))
        for wrapper in self.spec.additional_wrappers:
            if wrapper.entry_point == MONITOR_ENTRY_POINT:
                name = None if self.monitor_dir is None else os.path.join(self.monitor_dir, f"ars_candidate_{self.index}")
                env = Monitor(env, filename=name)
            else:
                env = cast(gym.Env, load_env_creator(wrapper.entry_point)(env=env, **(wrapper.kwargs or {})))
        return env


def env_recipe(env: VecEnv) -> EnvRecipe | str:
    """
    :param env: the training env
    :return: how to make more envs like its first one, or why they cannot be made
    """
    venv = env
    while isinstance(venv, VecEnvWrapper):
        if not isinstance(venv, KNOWN_VEC_WRAPPERS):
            return f"the training env is wrapped in {type(venv).__name__}"
        venv = venv.venv
    try:
        spec = venv.get_attr("spec", indices=[0])[0]
    except Exception as exc:
        return f"the spec of its envs cannot be read ({type(exc).__name__}: {exc})"
    if not isinstance(spec, EnvSpec):
        return "its envs have no spec (they were not made by gym.make)"
    for wrapper in spec.additional_wrappers:
        if wrapper.kwargs is None and wrapper.entry_point != MONITOR_ENTRY_POINT:
            return f"its wrapper {wrapper.name} does not record its arguments (gymnasium's RecordConstructorArgs)"
    return EnvRecipe(spec, _monitor_dir(venv))


def _monitor_dir(venv: VecEnv) -> str | None:
    """:return: the folder of the first env's Monitor file, or ``None`` (no file, or not in this process)"""
    if not isinstance(venv, DummyVecEnv):
        return None  # a Monitor's open file cannot be sent from a worker process (get_attr would kill SB3's worker)
    try:
        writer = venv.envs[0].get_wrapper_attr("results_writer")
    except AttributeError:
        return None
    name = getattr(getattr(writer, "file_handler", None), "name", None)
    return os.path.dirname(name) if isinstance(name, str) else None


def is_monitor_wrapped(env: VecEnv) -> bool:
    """:return: whether ``evaluate_policy`` takes ``env``'s episodes from Monitor's infos (its own test)"""
    return is_vecenv_wrapped(env, VecMonitor) or env.env_is_wrapped(Monitor)[0]


def make_candidate_env(
    n_envs: int,
    training_env: VecEnv,
    recipe: EnvRecipe | None,
    factory: Callable[[int], VecEnv] | None,
    vec_env_cls: type[VecEnv] | None,
    vec_env_kwargs: dict[str, Any] | None,
) -> VecEnv:
    """
    :param n_envs: envs the candidates need
    :param training_env: the model's env (whose spaces the candidates' envs must have)
    :param recipe: how to make one env like the training env's (used without ``factory``)
    :param factory: the user's ``candidate_env``: ``factory(n_envs)`` returns the VecEnv
    :param vec_env_cls: the VecEnv class for the recipe's envs (default :class:`BatchedSubprocVecEnv`)
    :param vec_env_kwargs: its further arguments (default, without ``vec_env_cls``: every env in this process)
    :return: the candidates' VecEnv
    """
    if factory is not None:
        env = factory(n_envs)
        if not isinstance(env, VecEnv):
            raise UserTypeError(f"candidate_env must return a VecEnv, got {type(env).__name__}")
    else:
        assert recipe is not None
        if vec_env_cls is None and vec_env_kwargs is None:
            # All in this process: an ARS policy's step is too cheap to hide a round trip to a worker behind.
            vec_env_cls, vec_env_kwargs = BatchedSubprocVecEnv, {"n_local": n_envs}
        env_fns = [replace(recipe, index=index) for index in range(n_envs)]
        env = (vec_env_cls or BatchedSubprocVecEnv)(env_fns, **(vec_env_kwargs or {}))  # type: ignore[arg-type]
    problem = None
    if env.num_envs != n_envs:
        problem = f"candidate_env({n_envs}) returned {env.num_envs} envs; return exactly the number of envs asked for"
    elif is_vecenv_wrapped(env, VecNormalize):
        problem = "the candidates' VecEnv must not be wrapped in VecNormalize: ARS normalises with the training env's"
    elif env.observation_space != training_env.observation_space or env.action_space != training_env.action_space:
        problem = "the candidates' envs must have the training env's observation and action spaces"
    if problem is not None:
        env.close()
        raise UserValueError(problem)
    return env
