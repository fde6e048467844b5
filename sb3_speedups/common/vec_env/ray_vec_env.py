"""
:class:`RayVecEnv`: BatchedSubprocVecEnv's idea (several envs per worker, stepped in turn) across the machines of a
Ray cluster. Each worker is a Ray actor (:class:`~sb3_speedups.common.vec_env.ray_actor.EnvActor`); one VecEnv step
is one actor call per actor, answered with that actor's observations, rewards, dones and the infos worth sending.
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from time import monotonic
from typing import Any

import gymnasium as gym
import numpy as np
from stable_baselines3.common.vec_env.base_vec_env import VecEnv, VecEnvIndices, VecEnvObs, VecEnvStepReturn
from stable_baselines3.common.vec_env.util import dict_to_obs, obs_space_info

from sb3_speedups.common.vec_env.env_group import resolve_indices
from sb3_speedups.common.vec_env.info_codec import InfoDecoder
from sb3_speedups.common.vec_env.pool import WorkerDiedError, reraise
from sb3_speedups.errors import MissingExtraError, UserError, UserValueError

try:
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
except ImportError:
    raise MissingExtraError("RayVecEnv needs Ray, which is not installed: pip install 'sb3-speedups[ray]'") from None

from sb3_speedups.common.vec_env.ray_actor import EnvActor, StepResult

POLL_S = 1.0  # a wait for actors checks this often that their nodes are still alive
CLOSE_WAIT_S = 10.0  # close() gives the actors this long to close their envs before killing them


@dataclass(eq=False)
class ActorHandle:
    """The training process's view of one actor: its handle, its envs, its node and its step in flight."""

    index: int
    actor: Any
    first: int
    stop: int
    where: str = ""
    node_id: str = ""
    pending: Any = None
    info_decoder: InfoDecoder = field(default_factory=InfoDecoder)


class RayVecEnv(VecEnv):
    """
    A VecEnv whose envs live in Ray actors, several per actor, on any machine of a Ray cluster; results are those of
    ``DummyVecEnv`` for the same seeds and actions. ``step_async`` returns at once, the actors step meanwhile.

    :param env_fns: functions that each create one env (pickled to the actors with cloudpickle)
    :param n_workers: actors; default: as many as the cluster has CPUs for (``num_cpus`` each), at most one per env
    :param envs_per_worker: envs per actor instead of ``n_workers`` (give one of the two)
    :param address: Ray cluster to connect to: ``"auto"`` (a cluster started on this machine with ``ray start``),
        ``"HOST:PORT"``, or ``None`` (``RAY_ADDRESS`` if set, else a new local Ray); ignored when Ray is already
        initialised in this process
    :param num_cpus: CPUs each actor reserves
    :param actor_options: further ``ray.remote`` options of the actors (``resources``, ``scheduling_strategy``, ...;
        actors are spread over the nodes by default)
    :param init_kwargs: further ``ray.init`` arguments, when this VecEnv initialises Ray
    :param startup_timeout_s: fail if the actors are not up after this long, in seconds (the cluster may lack the
        resources; on a busy machine starting the actors' Python processes alone can take minutes)
    :param step_timeout_s: fail if a step or command takes longer than this (``None``: wait as long as the actors'
        nodes are alive)
    """

    def __init__(
        self,
        env_fns: list[Callable[[], gym.Env]],
        n_workers: int | None = None,
        envs_per_worker: int | None = None,
        address: str | None = None,
        *,
        num_cpus: float = 1.0,
        actor_options: dict[str, Any] | None = None,
        init_kwargs: dict[str, Any] | None = None,
        startup_timeout_s: float = 300.0,
        step_timeout_s: float | None = None,
    ) -> None:
        n_envs = len(env_fns)
        _check_args(n_envs, n_workers, envs_per_worker, num_cpus)
        self.closed = False
        self.waiting = False
        self.broken: str | None = None
        self.step_timeout_s = step_timeout_s
        self._actors: list[ActorHandle] = []
        if not ray.is_initialized():
            ray.init(address=address, **(init_kwargs or {}))
        try:
            observation_space, action_space = self._start_actors(
                env_fns, n_workers, envs_per_worker, num_cpus, actor_options, startup_timeout_s
            )
        except BaseException:
            self._kill_actors()
            raise
        keys, shapes, dtypes = obs_space_info(observation_space)
        self._obs_buffers = OrderedDict((key, np.zeros((n_envs, *shapes[key]), dtype=dtypes[key])) for key in keys)
        self._rewards = np.zeros(n_envs, dtype=np.float32)
        self._dones = np.zeros(n_envs, dtype=bool)
        super().__init__(n_envs, observation_space, action_space)
        # As DummyVecEnv: the envs' own metadata (render_fps for video recorders, ...)
        self.metadata = self.get_attr("metadata", indices=[0])[0]

    # --- start-up -------------------------------------------------------------------------------------------
    def _start_actors(
        self,
        env_fns: list[Callable[[], gym.Env]],
        n_workers: int | None,
        envs_per_worker: int | None,
        num_cpus: float,
        actor_options: dict[str, Any] | None,
        timeout_s: float,
    ) -> tuple[gym.spaces.Space, gym.spaces.Space]:
        n_envs = len(env_fns)
        if envs_per_worker is not None:
            n_workers = math.ceil(n_envs / envs_per_worker)
        elif n_workers is None:
            cpus = ray.cluster_resources().get("CPU", 1)
            n_workers = max(1, int(cpus // num_cpus if num_cpus > 0 else cpus))
        n_workers = min(n_workers, n_envs)
        options = {"num_cpus": num_cpus, "scheduling_strategy": "SPREAD", "max_restarts": 0, **(actor_options or {})}
        remote_cls = ray.remote(EnvActor).options(**options)
        bounds = np.linspace(0, n_envs, n_workers + 1).round().astype(int).tolist()
        for index, (first, stop) in enumerate(itertools.pairwise(bounds)):
            actor = remote_cls.remote(index, first, env_fns[first:stop])
            self._actors.append(ActorHandle(index, actor, first, stop))
        refs = [handle.actor.start.remote() for handle in self._actors]
        try:
            replies = self._get(refs, self._actors, "start-up", timeout_s)
        except GetTimeoutError:
            raise UserError(
                f"RayVecEnv: {n_workers} actors of {num_cpus} CPUs each did not start within {timeout_s:g} s; the cluster "
                f"has {ray.cluster_resources().get('CPU', 0):g} CPUs: lower n_workers or num_cpus, or add nodes"
            ) from None
        for handle, reply in zip(self._actors, replies, strict=True):
            handle.where, handle.node_id = reply[2], reply[3]
        return replies[0][0], replies[0][1]

    # --- waiting for actors ---------------------------------------------------------------------------------
    def _get(self, refs: list[Any], handles: Sequence[ActorHandle], during: str, timeout_s: float | None = None) -> list[Any]:
        """
        The replies of ``handles`` to ``refs``; the first env error among them is re-raised here once all replied.
        A dead actor or node raises :class:`WorkerDiedError` within about ``POLL_S`` of Ray noticing it.
        """
        deadline = None if timeout_s is None else monotonic() + timeout_s
        waiting = list(refs)
        while waiting:
            _, waiting = ray.wait(waiting, num_returns=len(waiting), timeout=POLL_S)
            if waiting:
                self._check_nodes(handles, refs, waiting, during)
                if deadline is not None and monotonic() > deadline:
                    self.broken = (
                        f"RayVecEnv: {during} did not finish within {timeout_s:g} s; close this VecEnv and create a new one"
                    )
                    raise GetTimeoutError(self.broken)
        replies = []
        for handle, ref in zip(handles, refs, strict=True):
            try:
                replies.append(ray.get(ref))
            except RayActorError as exc:
                self._break(handle, during, f"died ({type(exc).__name__}: {_first_line(exc)})")
        error = next((value for ok, value in replies if not ok), None)
        if error is not None:
            reraise(error)
        return [value for _, value in replies]

    def _check_nodes(self, handles: Sequence[ActorHandle], refs: list[Any], waiting: list[Any], during: str) -> None:
        alive = {node["NodeID"] for node in ray.nodes() if node.get("Alive")}
        for handle, ref in zip(handles, refs, strict=True):
            if ref in waiting and handle.node_id and handle.node_id not in alive:
                self._break(handle, during, f"lost its node {handle.node_id[:12]}")

    def _break(self, handle: ActorHandle, during: str, how: str) -> None:
        self.broken = (
            f"RayVecEnv actor {handle.index} (envs {handle.first}-{handle.stop - 1}, {handle.where}) {how} during {during}; "
            "close this VecEnv and create a new one"
        )
        raise WorkerDiedError(self.broken)

    def _check_usable(self, what: str) -> None:
        if self.broken is not None:
            raise WorkerDiedError(self.broken)
        if self.closed:
            raise UserError("this RayVecEnv is closed; create a new one")
        if self.waiting:
            raise UserError(f"{what} called while a step is pending; call step_wait first")

    # --- VecEnv API -----------------------------------------------------------------------------------------
    def step_async(self, actions: np.ndarray) -> None:
        self._check_usable("step_async")
        for handle in self._actors:
            handle.pending = handle.actor.step.remote(actions[handle.first : handle.stop])
        self.waiting = True

    def step_wait(self) -> VecEnvStepReturn:
        if not self.waiting:
            raise UserError("step_wait called without step_async")
        self.waiting = False
        refs = [handle.pending for handle in self._actors]
        for handle in self._actors:
            handle.pending = None
        results: list[StepResult] = self._get(refs, self._actors, "step", self.step_timeout_s)
        infos: list[dict[str, Any]] = [{"TimeLimit.truncated": False} for _ in range(self.num_envs)]
        for handle, (obs_parts, rewards, dones, encoded) in zip(self._actors, results, strict=True):
            span = slice(handle.first, handle.stop)
            self._save_obs(span, obs_parts)
            self._rewards[span] = rewards
            self._dones[span] = dones
            if encoded:
                for row, info, reset_info in handle.info_decoder.decode(encoded):
                    infos[handle.first + row] = info
                    if reset_info is not None:
                        self.reset_infos[handle.first + row] = reset_info
        return self._obs(), self._rewards.copy(), self._dones.copy(), infos

    def reset(self) -> VecEnvObs:
        if self.waiting:  # reset cancels a pending step, as SB3 documents
            self._drain()
        self._check_usable("reset")
        refs = [
            handle.actor.reset.remote(self._seeds[handle.first : handle.stop], self._options[handle.first : handle.stop])
            for handle in self._actors
        ]
        for handle, (obs_parts, reset_infos) in zip(self._actors, self._get(refs, self._actors, "reset"), strict=True):
            self._save_obs(slice(handle.first, handle.stop), obs_parts)
            self.reset_infos[handle.first : handle.stop] = reset_infos
        self._reset_seeds()
        self._reset_options()
        return self._obs()

    def _drain(self) -> None:
        self.waiting = False
        handles = [handle for handle in self._actors if handle.pending is not None]
        refs = [handle.pending for handle in handles]
        for handle in handles:
            handle.pending = None
        try:
            self._get(refs, handles, "step")
        except WorkerDiedError:
            raise
        except Exception:  # the error of a step that reset cancels
            pass

    def _save_obs(self, span: slice, obs_parts: list[np.ndarray]) -> None:
        for buffer, part in zip(self._obs_buffers.values(), obs_parts, strict=True):
            buffer[span] = part

    def _obs(self) -> VecEnvObs:
        # An OrderedDict of copies, as DummyVecEnv returns for Dict spaces
        return dict_to_obs(self.observation_space, OrderedDict((k, v.copy()) for k, v in self._obs_buffers.items()))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.broken is None and ray.is_initialized():
                refs = [handle.actor.close.remote() for handle in self._actors]
                ray.wait(refs, num_returns=len(refs), timeout=CLOSE_WAIT_S)
        except Exception:  # the envs could not be closed cleanly: the actors are killed below anyway
            pass
        finally:
            self._kill_actors()

    def _kill_actors(self) -> None:
        actors, self._actors = self._actors, []
        for handle in actors:
            try:
                ray.kill(handle.actor)
            except Exception:  # already dead, or Ray shut down: nothing left to kill
                pass

    def _command(self, name: str, args: tuple[Any, ...], indices: VecEnvIndices) -> list[Any]:
        """Run an :data:`ENV_COMMANDS` command on the envs ``indices``; results in the order of ``indices``."""
        self._check_usable(name)
        order = resolve_indices(self._get_indices(indices), self.num_envs)
        # Positions in ``order`` served by each actor (an index may repeat)
        positions = {h: pos for h in self._actors if (pos := [p for p, i in enumerate(order) if h.first <= i < h.stop])}
        refs = [h.actor.command.remote(name, args, [order[p] - h.first for p in pos]) for h, pos in positions.items()]
        results: list[Any] = [None] * len(order)
        for pos, values in zip(positions.values(), self._get(refs, list(positions), name, self.step_timeout_s), strict=True):
            for p, value in zip(pos, values, strict=True):
                results[p] = value
        return results

    def get_attr(self, attr_name: str, indices: VecEnvIndices = None) -> list[Any]:
        return self._command("get_attr", (attr_name,), indices)

    def set_attr(self, attr_name: str, value: Any, indices: VecEnvIndices = None) -> None:
        self._command("set_attr", (attr_name, value), indices)

    def env_method(self, method_name: str, *method_args, indices: VecEnvIndices = None, **method_kwargs) -> list[Any]:
        return self._command("env_method", (method_name, method_args, method_kwargs), indices)

    def env_is_wrapped(self, wrapper_class: type[gym.Wrapper], indices: VecEnvIndices = None) -> list[bool]:
        return self._command("is_wrapped", (wrapper_class,), indices)

    def get_images(self) -> Sequence[np.ndarray | None]:
        if self.render_mode != "rgb_array":
            warnings.warn(
                f"The render mode is {self.render_mode}, but this method assumes it is `rgb_array` to obtain images."
            )
            return [None for _ in range(self.num_envs)]
        return self._command("get_images", (), None)

    def actor_pids(self) -> list[int]:
        """:return: the process id of each actor (on its own node)"""
        self._check_usable("actor_pids")
        return ray.get([handle.actor.pid.remote() for handle in self._actors])

    def actor_node_ids(self) -> list[str]:
        """:return: the Ray node id of each actor"""
        return [handle.node_id for handle in self._actors]


def _first_line(exc: BaseException) -> str:
    return next((line for line in str(exc).splitlines() if line.strip()), "")


def _check_args(n_envs: int, n_workers: int | None, envs_per_worker: int | None, num_cpus: float) -> None:
    if n_envs == 0:
        raise UserValueError("RayVecEnv needs at least one env function")
    if n_workers is not None and envs_per_worker is not None:
        raise UserValueError("give n_workers or envs_per_worker, not both")
    for name, value in (("n_workers", n_workers), ("envs_per_worker", envs_per_worker)):
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise UserValueError(f"{name} must be a positive integer or None, got {value!r}")
    if not num_cpus >= 0:
        raise UserValueError(f"num_cpus must be >= 0, got {num_cpus!r}")
