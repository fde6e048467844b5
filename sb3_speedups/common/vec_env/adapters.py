"""
Other fast vectorised envs presented as SB3 VecEnvs with SB3's auto-reset semantics: when an env finishes, the
returned observation is already the first one of its next episode, the last one is in
``info["terminal_observation"]``, ``info["TimeLimit.truncated"]`` says whether it was cut by a time limit, and
``reset_infos`` holds the info of the automatic reset.

- :class:`EnvPoolVecEnv`: EnvPool's C++ thread pool (``pip install sb3-speedups[envpool]``).
- :class:`GymVectorVecEnv`: gymnasium's vector envs, e.g. the numpy ``CartPoleVectorEnv`` or ``SyncVectorEnv``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from stable_baselines3.common.env_util import is_wrapped
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn

from sb3_speedups.common.vec_env.vector_infos import cartpole_partial_reset, split_infos, take_obs, write_obs
from sb3_speedups.errors import UserError, UserValueError


class VectorAdapter(VecEnv):
    """
    Common part of the adapters: SB3's auto-reset on top of a batched step and a reset of some envs.

    Subclasses implement ``_step_batch`` (batched step, no reset handling), ``_reset_some`` (reset the given envs,
    return their observations and infos) and ``from_env_id`` (build the adapter the way ``make_vec_env`` does).
    """

    def _step_batch(self, actions: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        raise NotImplementedError

    def _reset_some(self, indices: np.ndarray) -> tuple[Any, list[dict[str, Any]]]:
        raise NotImplementedError

    @classmethod
    def from_env_id(
        cls, env_id: str, n_envs: int, seed: int | None = None, env_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> VectorAdapter:
        """
        :param env_id: registered env id
        :param n_envs: number of envs
        :param seed: base seed (env ``i`` gets ``seed + i``), applied at the first ``reset``
        :param env_kwargs: keyword arguments of the env
        :param kwargs: keyword arguments of the adapter's vector env
        :return: the adapter
        """
        raise NotImplementedError

    def step_async(self, actions: np.ndarray) -> None:
        self._actions = actions

    def step_wait(self) -> VecEnvStepReturn:
        obs, rewards, terminated, truncated, infos = self._step_batch(self._actions)
        return self._auto_reset(obs, rewards, terminated, truncated, infos)

    def _auto_reset(
        self, obs: Any, rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, infos: list[dict[str, Any]]
    ) -> VecEnvStepReturn:
        dones = np.logical_or(terminated, truncated)
        for index, info in enumerate(infos):
            info["TimeLimit.truncated"] = bool(truncated[index] and not terminated[index])
        done_ids = np.flatnonzero(dones)
        if done_ids.size:
            for done_id in done_ids.tolist():
                infos[done_id]["terminal_observation"] = take_obs(obs, done_id)
            reset_obs, reset_infos = self._reset_some(done_ids)
            write_obs(obs, done_ids, reset_obs)
            for done_id, reset_info in zip(done_ids.tolist(), reset_infos, strict=True):
                self.reset_infos[done_id] = reset_info
        return obs, np.asarray(rewards, dtype=np.float32), dones, infos

    def _options_for_all(self) -> dict[str, Any] | None:
        first = self._options[0]
        if any(options != first for options in self._options):
            raise UserValueError(f"{type(self).__name__} takes one options dict for all envs; call set_options(dict)")
        return first or None

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return [False for _ in self._get_indices(indices)]


class EnvPoolVecEnv(VectorAdapter):
    """
    An EnvPool pool as an SB3 VecEnv (EnvPool's own next-step auto-reset is replaced by an immediate reset).

    :param env_id: EnvPool task id, e.g. ``CartPole-v1`` or ``HalfCheetah-v5``
    :param n_envs: number of envs
    :param seed: base seed; ``None`` draws one (``seed()`` before ``reset()`` overrides it, as in SB3)
    :param envpool_kwargs: further ``envpool.make`` arguments
    """

    def __init__(self, env_id: str, n_envs: int, seed: int | None = None, **envpool_kwargs: Any) -> None:
        try:
            import envpool
        except ImportError:
            raise UserError("EnvPool is not installed; pip install 'sb3-speedups[envpool]'") from None
        if env_id not in envpool.list_all_envs():
            raise UserValueError(f"EnvPool has no env {env_id!r}; see envpool.list_all_envs()")
        self._envpool, self._env_id, self._kwargs = envpool, env_id, envpool_kwargs
        self._pool_seed = int(np.random.randint(0, 2**31 - 1)) if seed is None else int(seed)
        self._pool = self._make_pool(n_envs, self._pool_seed)
        super().__init__(n_envs, self._pool.observation_space, self._pool.action_space)

    def _make_pool(self, n_envs: int, seed: int) -> Any:
        return self._envpool.make(self._env_id, env_type="gymnasium", num_envs=n_envs, seed=seed, **self._kwargs)

    @classmethod
    def from_env_id(
        cls, env_id: str, n_envs: int, seed: int | None = None, env_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> EnvPoolVecEnv:
        return cls(env_id, n_envs, seed=seed, **{**(env_kwargs or {}), **kwargs})

    def _infos(self, info: dict[str, Any], n: int) -> list[dict[str, Any]]:
        return split_infos({key: value for key, value in info.items() if key != "players"}, n)

    def _step_batch(self, actions: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        obs, rewards, terminated, truncated, info = self._pool.step(np.asarray(actions))
        return obs, rewards, terminated, truncated, self._infos(info, self.num_envs)

    def _reset_some(self, indices: np.ndarray) -> tuple[Any, list[dict[str, Any]]]:
        obs, info = self._pool.reset(indices.astype(np.int32))
        return obs, self._infos(info, len(indices))

    def reset(self) -> VecEnvObs:
        if self._options_for_all():
            raise UserValueError("EnvPool envs take no reset options")
        seed = self._seeds[0]
        if seed is not None and seed != self._pool_seed:
            # EnvPool seeds env i with seed + i when the pool is made, exactly what VecEnv.seed(seed) asks for.
            self._pool.close()
            self._pool_seed = int(seed)
            self._pool = self._make_pool(self.num_envs, self._pool_seed)
        obs, info = self._pool.reset()
        self.reset_infos = self._infos(info, self.num_envs)
        self._reset_seeds()
        self._reset_options()
        return obs

    def close(self) -> None:
        self._pool.close()

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        if attr_name == "render_mode":
            return [None for _ in self._get_indices(indices)]
        value = getattr(self._pool, attr_name)
        return [value for _ in self._get_indices(indices)]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        raise UserError("EnvPool envs have no per-env Python attributes to set")

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        raise UserError("EnvPool envs have no per-env Python methods to call")

    def get_images(self) -> Sequence[np.ndarray | None]:
        return [None for _ in range(self.num_envs)]


class GymVectorVecEnv(VectorAdapter):
    """
    A gymnasium vector env as an SB3 VecEnv.

    Same-step auto-reset envs are used as they are, disabled ones are reset with ``reset_mask``, and the numpy
    ``CartPoleVectorEnv`` (next-step auto-reset) is reset exactly as it would reset itself, one step earlier.

    :param vector_env: the vector env
    """

    def __init__(self, vector_env: gym.vector.VectorEnv) -> None:
        self.vector_env = vector_env
        self._mode = AutoresetMode(vector_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP))
        self._partial_reset = cartpole_partial_reset if _is_cartpole_vector(vector_env) else None
        if self._mode == AutoresetMode.NEXT_STEP and self._partial_reset is None:
            raise UserValueError(
                f"{type(vector_env.unwrapped).__name__} resets envs on the step after they finish, which SB3 cannot use; "
                "create it with autoreset_mode=AutoresetMode.SAME_STEP (gym.make_vec(..., vectorization_mode='sync', "
                "vector_kwargs={'autoreset_mode': 'SameStep'}))"
            )
        self._per_env = isinstance(vector_env.unwrapped, (SyncVectorEnv, gym.vector.AsyncVectorEnv))
        super().__init__(vector_env.num_envs, vector_env.single_observation_space, vector_env.single_action_space)

    @classmethod
    def from_env_id(
        cls, env_id: str, n_envs: int, seed: int | None = None, env_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> GymVectorVecEnv:
        spec = gym.spec(env_id)
        if "vectorization_mode" not in kwargs and spec.vector_entry_point is None:
            kwargs = {"vectorization_mode": "sync", "vector_kwargs": {"autoreset_mode": AutoresetMode.SAME_STEP}, **kwargs}
        adapter = cls(gym.make_vec(env_id, num_envs=n_envs, **(env_kwargs or {}), **kwargs))
        adapter.seed(seed)
        return adapter

    def _step_batch(self, actions: np.ndarray) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, list[dict[str, Any]]]:
        obs, rewards, terminated, truncated, info = self.vector_env.step(actions)
        return obs, rewards, terminated, truncated, split_infos(info, self.num_envs)

    def step_wait(self) -> VecEnvStepReturn:
        if self._mode != AutoresetMode.SAME_STEP:
            return super().step_wait()
        # The vector env already reset the finished envs: their last observation and info are under "final_*".
        obs, rewards, terminated, truncated, info = self.vector_env.step(self._actions)
        final_obs, final_info = info.pop("final_obs", None), info.pop("final_info", {})
        info.pop("_final_obs", None)
        info.pop("_final_info", None)
        infos, final_infos = split_infos(info, self.num_envs), split_infos(final_info, self.num_envs)
        dones = np.logical_or(terminated, truncated)
        for index in range(self.num_envs):
            if dones[index]:
                self.reset_infos[index] = infos[index]
                infos[index] = final_infos[index]
            infos[index]["TimeLimit.truncated"] = bool(truncated[index] and not terminated[index])
            if dones[index]:
                infos[index]["terminal_observation"] = final_obs[index]  # type: ignore[index]
        return obs, np.asarray(rewards, dtype=np.float32), dones, infos

    def _reset_some(self, indices: np.ndarray) -> tuple[Any, list[dict[str, Any]]]:
        if self._partial_reset is not None:
            return self._partial_reset(self.vector_env.unwrapped, indices)
        mask = np.zeros(self.num_envs, dtype=bool)
        mask[indices] = True
        obs, info = self.vector_env.reset(options={"reset_mask": mask})
        infos = split_infos(info, self.num_envs)
        return take_obs(obs, indices), [infos[int(i)] for i in indices]

    def reset(self) -> VecEnvObs:
        options = self._options_for_all()
        if self._per_env:
            seed: Any = list(self._seeds)
        else:
            # One RNG for the whole batch: seeded by the first env's seed (the others follow it, as with seed()).
            seed = self._seeds[0]
        obs, info = self.vector_env.reset(seed=seed, options=options)
        self.reset_infos = split_infos(info, self.num_envs)
        self._reset_seeds()
        self._reset_options()
        return obs

    def close(self) -> None:
        self.vector_env.close()

    def _sub_envs(self, indices: VecEnvIndices) -> list[gym.Env] | None:
        if isinstance(self.vector_env.unwrapped, SyncVectorEnv):
            envs = self.vector_env.unwrapped.envs
            return [envs[i] for i in self._get_indices(indices)]
        return None

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        envs = self._sub_envs(indices)
        if envs is not None:
            return [env.get_wrapper_attr(attr_name) for env in envs]
        ids = list(self._get_indices(indices))
        if self._per_env:
            values = self.vector_env.get_attr(attr_name)  # type: ignore[attr-defined]
            return [values[i] for i in ids]
        return [getattr(self.vector_env, attr_name) for _ in ids]

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        envs = self._sub_envs(indices)
        if envs is not None:
            for env in envs:
                setattr(env, attr_name, value)
        elif indices is None:
            setattr(self.vector_env, attr_name, value)
        else:
            raise UserValueError(
                f"{type(self.vector_env).__name__} cannot set an attribute of some envs only; pass indices=None"
            )

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        envs = self._sub_envs(indices)
        if envs is not None:
            return [env.get_wrapper_attr(method_name)(*method_args, **method_kwargs) for env in envs]
        if indices is None and self._per_env:
            return list(self.vector_env.call(method_name, *method_args, **method_kwargs))  # type: ignore[attr-defined]
        raise UserValueError(f"{type(self.vector_env).__name__} cannot call a method of some envs only; pass indices=None")

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        envs = self._sub_envs(indices)
        return (
            [is_wrapped(env, wrapper_class) for env in envs]
            if envs is not None
            else super().env_is_wrapped(wrapper_class, indices)
        )

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            return [None for _ in range(self.num_envs)]
        return list(self.vector_env.render())  # type: ignore[arg-type]


def _is_cartpole_vector(vector_env: gym.vector.VectorEnv) -> bool:
    from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv

    return isinstance(vector_env.unwrapped, CartPoleVectorEnv)
