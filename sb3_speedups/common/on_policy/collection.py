"""
Collecting one on-policy rollout with an actor (:mod:`sb3_speedups.common.acting.actors`): one batched policy call per
vectorised step, SB3's semantics kept (``callback.on_step`` once per step with ``update_locals``, episode info
buffer, ``_last_obs``/``_last_episode_starts``, timeout bootstrap with the terminal observation's value, ``Box``
action clipping, gSDE noise resampling).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch as th
from stable_baselines3.common.base_class import BaseAlgorithm
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.on_policy.timeouts import bootstrap_timeouts
from sb3_speedups.common.training_mode import set_training_mode
from sb3_speedups.common.vec_env.stepping import SubsetSteppingMixin
from sb3_speedups.common.on_policy.buffers import FastRolloutBase
from sb3_speedups.errors import UserError


class Actor(Protocol):
    """What the collection loop needs from an actor."""

    def act(self, obs: Any, masks: np.ndarray | None = None) -> tuple[np.ndarray, th.Tensor, th.Tensor]: ...

    def predict_values(self, obs: Any) -> th.Tensor: ...

    def env_actions(self, actions: np.ndarray) -> np.ndarray: ...

    def reset_noise(self, n_envs: int) -> None: ...


def record_step(
    model: BaseAlgorithm,
    env: VecEnv,
    callback: BaseCallback,
    rollout_buffer: FastRolloutBase,
    actor: Actor,
    gamma: float,
    step_locals: dict[str, Any],
) -> bool:
    """
    Everything after one vectorised step: count it, call the callback, log episodes, bootstrap timeouts, store it.

    :param step_locals: the collection loop's locals (``callback.locals``): ``actions``, ``values``, ``log_probs``,
        ``new_obs``, ``rewards``, ``dones``, ``infos`` of the step, and ``action_masks`` (stored when not ``None``)
    :return: ``False`` when a callback stopped training (nothing is stored then, as in SB3)
    """
    model.num_timesteps += env.num_envs
    callback.update_locals(step_locals)
    if not callback.on_step():
        return False
    rewards, dones, infos = step_locals["rewards"], step_locals["dones"], step_locals["infos"]
    model._update_info_buffer(infos, dones)
    timeouts = bootstrap_timeouts(rewards, dones, infos, gamma, lambda envs, obs: actor.predict_values(obs))
    if timeouts is not None:
        rollout_buffer.add_timeouts(timeouts)
    action_masks = step_locals.get("action_masks")
    rollout_buffer.add(
        model._last_obs,  # type: ignore[arg-type]
        step_locals["actions"],
        rewards,
        model._last_episode_starts,  # type: ignore[arg-type]
        step_locals["values"],
        step_locals["log_probs"],
        **({} if action_masks is None else {"action_masks": action_masks}),
    )
    model._last_obs = step_locals["new_obs"]
    model._last_episode_starts = dones
    return True


def collect_rollout(
    model: BaseAlgorithm,
    env: VecEnv,
    callback: BaseCallback,
    rollout_buffer: FastRolloutBase,
    n_rollout_steps: int,
    actor: Actor,
    gamma: float,
    masks_of: Callable[[], np.ndarray] | None = None,
) -> bool:
    """
    Fill ``rollout_buffer`` with ``n_rollout_steps`` steps of every env and compute its advantages
    (``OnPolicyAlgorithm.collect_rollouts`` with a frozen actor).

    :param model: the algorithm (its ``_last_obs``, ``num_timesteps``, info buffers and gSDE settings are used)
    :param env: the training env
    :param callback: called once per vectorised step
    :param rollout_buffer: the buffer to fill
    :param n_rollout_steps: steps per env
    :param actor: acts for all envs at once
    :param gamma: discount of the timeout bootstrap
    :param masks_of: returns the envs' current action masks (sb3-contrib's ``get_action_masks``), for masked acting
    :return: ``False`` when a callback stopped training
    """
    self = model  # callbacks may read ``locals()["self"]``, as in SB3's loop
    assert self._last_obs is not None, "No previous observation was provided"
    set_training_mode(self, False)
    n_steps = 0
    action_masks = None
    rollout_buffer.reset()
    if self.use_sde:
        actor.reset_noise(env.num_envs)
    callback.on_rollout_start()
    while n_steps < n_rollout_steps:
        if self.use_sde and self.sde_sample_freq > 0 and n_steps % self.sde_sample_freq == 0:
            actor.reset_noise(env.num_envs)
        if masks_of is not None:
            action_masks = masks_of()
        actions, values, log_probs = actor.act(self._last_obs, action_masks)
        clipped_actions = actor.env_actions(actions)
        new_obs, rewards, dones, infos = env.step(clipped_actions)
        if not record_step(self, env, callback, rollout_buffer, actor, gamma, locals()):
            return False
        n_steps += 1
    values = actor.predict_values(new_obs)
    rollout_buffer.set_last_observations(new_obs)
    rollout_buffer.compute_returns_and_advantage(last_values=values, dones=dones)
    callback.update_locals(locals())
    callback.on_rollout_end()
    return True


def take(obs: Any, indices: np.ndarray) -> Any:
    """:return: the rows ``indices`` of a batch of observations (an array or a dict of arrays)"""
    if isinstance(obs, dict):
        return {key: value[indices] for key, value in obs.items()}
    return obs[indices]


def _join(parts: list[Any]) -> Any:
    if isinstance(parts[0], dict):
        return {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    if isinstance(parts[0], th.Tensor):
        return th.cat(parts)
    if isinstance(parts[0], list):
        return [item for part in parts for item in part]
    return np.concatenate(parts)


@dataclass
class _Acted:
    """What the policy did for one half of the envs, whose step is under way."""

    actions: np.ndarray
    values: th.Tensor
    log_probs: th.Tensor
    clipped_actions: np.ndarray


def double_buffer_unsupported_reason(model: BaseAlgorithm, env: VecEnv) -> str | None:
    """:return: why :func:`collect_rollout_double_buffered` cannot collect from ``env``, or ``None`` when it can"""
    if not isinstance(env, SubsetSteppingMixin):
        return (
            f"the training env is a {type(env).__name__}: double_buffer=True needs a BatchedSubprocVecEnv as the "
            "training env itself (no VecEnv wrapper such as VecNormalize around it)"
        )
    if model.use_sde:
        return "double_buffer=True does not support gSDE (its exploration noise is drawn for all envs at once)"
    try:
        env.halves()
    except UserError as exc:
        return f"double_buffer=True: {exc}"
    return None


def collect_rollout_double_buffered(
    model: BaseAlgorithm,
    env: VecEnv,
    callback: BaseCallback,
    rollout_buffer: FastRolloutBase,
    n_rollout_steps: int,
    actor: Actor,
    gamma: float,
) -> bool:
    """
    :func:`collect_rollout` with the envs split in two halves that step in turn: while one half steps (in its worker
    processes), the policy acts for the other, so env time and inference time overlap.

    The frozen policy acts for every env from the same observations as in :func:`collect_rollout`, and a whole
    vectorised step is assembled before the callback and the buffer see it, so the rollout is the same. Random draws
    come in the same order (half A, then half B, per step); categorical sampling draws the same numbers for any batch
    size, so with ``Discrete``/``MultiDiscrete``/``MultiBinary`` actions the rollout is identical to the plain one for
    one seed; torch's Gaussian sampler draws differently for batches under 16 numbers, so ``Box`` actions are
    equally distributed but not the same numbers. Nothing is stepped beyond the rollout's last step, so the next
    rollout starts from the updated policy. If a callback stops training, the step already started for the next
    actions is finished (not recorded) and ``_last_obs`` follows the envs.

    :return: ``False`` when a callback stopped training
    """
    self = model  # callbacks may read ``locals()["self"]``, as in SB3's loop
    assert self._last_obs is not None, "No previous observation was provided"
    assert isinstance(env, SubsetSteppingMixin)
    set_training_mode(self, False)
    halves = env.halves()
    n_steps = 0
    rollout_buffer.reset()
    callback.on_rollout_start()

    def launch(indices: np.ndarray, obs: Any) -> _Acted:
        actions, values, log_probs = actor.act(obs)
        clipped = actor.env_actions(actions)
        env.step_async_indices(clipped, indices)
        return _Acted(actions, values, log_probs, clipped)

    started = [launch(indices, take(self._last_obs, indices)) for indices in halves]
    while n_steps < n_rollout_steps:
        results, next_started = [], []
        for indices in halves:
            results.append(env.step_wait_indices(indices))
            if n_steps + 1 < n_rollout_steps:
                next_started.append(launch(indices, results[-1][0]))
        actions, values = _join([a.actions for a in started]), _join([a.values for a in started])
        log_probs, clipped_actions = _join([a.log_probs for a in started]), _join([a.clipped_actions for a in started])
        new_obs, rewards, dones, infos = (_join(list(part)) for part in zip(*results, strict=True))
        started = next_started
        if not record_step(self, env, callback, rollout_buffer, actor, gamma, locals()):
            if started:  # finish the steps already under way, so the envs stay usable
                finished = [env.step_wait_indices(indices) for indices in halves]
                self._last_obs = _join([result[0] for result in finished])
                self._last_episode_starts = _join([result[2] for result in finished])
            return False
        n_steps += 1
    values = actor.predict_values(new_obs)
    rollout_buffer.set_last_observations(new_obs)
    rollout_buffer.compute_returns_and_advantage(last_values=values, dones=dones)
    callback.update_locals(locals())
    callback.on_rollout_end()
    return True
