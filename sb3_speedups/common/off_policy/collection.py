"""
One lean collection loop for the off-policy algorithms (DQN, SAC, TD3, DDPG), with exactly the effects of stock
``OffPolicyAlgorithm.collect_rollouts``: the same RNG draws, replay-buffer contents, callbacks, episode and info
buffers, progress, ``_on_step`` calls, logging and :class:`~stable_baselines3.common.type_aliases.RolloutReturn`.

Use it by putting :class:`FastOffPolicyCollection` first among the bases of a stock off-policy class::

    class DQN(FastOffPolicyCollection, stable_baselines3.DQN): ...

Hooks, all stock's, so that a subclass speeds up one concern without touching the loop:

- ``_sample_action(learning_starts, action_noise, n_envs) -> (env actions, buffer actions)``: acting. Stock's
  contract (uniform ``action_space.sample()`` draws before ``learning_starts``, else the policy, then the action
  noise for ``Box`` actions); an algorithm overrides it to act from its frozen copy (DQN does).
- ``_store_transition``: overridden here (no deep copy of the observations unless a terminal observation must be
  patched in, see :mod:`sb3_speedups.common.off_policy.transitions`); ``_update_info_buffer``, ``_on_step``,
  ``dump_logs``, ``_update_current_progress_remaining``: called as stock calls them.

Subclasses must not override ``collect_rollouts`` other than to wrap it (sync a frozen copy, then ``super()``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.noise import ActionNoise
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.type_aliases import RolloutReturn, TrainFreq, TrainFrequencyUnit
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.off_policy.transitions import copies_on_add, store_transition
from sb3_speedups.common.training_mode import FastTrainingMode


class FastOffPolicyCollection(FastTrainingMode, OffPolicyAlgorithm):
    """
    Mixin for subclasses of a stock off-policy algorithm: replaces ``collect_rollouts`` and ``_store_transition``
    with lean versions of the same effects (see the module docstring for the hooks).
    """

    def collect_rollouts(
        self,
        env: VecEnv,
        callback: BaseCallback,
        train_freq: TrainFreq,
        replay_buffer: ReplayBuffer,
        action_noise: ActionNoise | None = None,
        learning_starts: int = 0,
        log_interval: int | None = None,
    ) -> RolloutReturn:
        """Collect ``train_freq`` steps or episodes into ``replay_buffer``, as stock's ``collect_rollouts`` does."""
        self._set_training_mode(False)
        assert isinstance(env, VecEnv), "You must pass a VecEnv"
        assert train_freq.frequency > 0, "Should at least collect one step or episode."
        n_envs = env.num_envs
        if n_envs > 1:
            assert train_freq.unit == TrainFrequencyUnit.STEP, "You must use only one env when doing episodic training."
        if train_freq.unit not in (TrainFrequencyUnit.STEP, TrainFrequencyUnit.EPISODE):
            raise ValueError(
                f"The unit of the `train_freq` must be either TrainFrequencyUnit.STEP or TrainFrequencyUnit.EPISODE "
                f"not '{train_freq.unit}'!"
            )
        count_steps = train_freq.unit == TrainFrequencyUnit.STEP
        use_sde = self.use_sde
        sde_every = self.sde_sample_freq if use_sde else 0
        if use_sde:
            self.actor.reset_noise(n_envs)  # type: ignore[attr-defined,operator]

        callback.on_rollout_start()
        # What stock's callbacks find in ``self.locals`` (its loop's local variables), refreshed in place each step.
        seen: dict[str, Any] = dict(
            self=self,
            env=env,
            callback=callback,
            train_freq=train_freq,
            replay_buffer=replay_buffer,
            action_noise=action_noise,
            learning_starts=learning_starts,
            log_interval=log_interval,
            continue_training=True,
        )
        steps = episodes = 0
        while (steps if count_steps else episodes) < train_freq.frequency:
            if sde_every > 0 and steps % sde_every == 0:
                self.actor.reset_noise(n_envs)  # type: ignore[attr-defined,operator]
            actions, buffer_actions = self._sample_action(learning_starts, action_noise, n_envs)
            new_obs, rewards, dones, infos = env.step(actions)
            self.num_timesteps += n_envs
            steps += 1

            seen.update(
                num_collected_steps=steps,
                num_collected_episodes=episodes,
                actions=actions,
                buffer_actions=buffer_actions,
                new_obs=new_obs,
                rewards=rewards,
                dones=dones,
                infos=infos,
            )
            callback.update_locals(seen)
            if not callback.on_step():  # only False stops, not None
                return RolloutReturn(steps * n_envs, episodes, continue_training=False)

            self._update_info_buffer(infos, dones)
            self._store_transition(replay_buffer, buffer_actions, new_obs, rewards, dones, infos)  # type: ignore[arg-type]
            self._update_current_progress_remaining(self.num_timesteps, self._total_timesteps)
            self._on_step()

            # count_nonzero, unlike .any(), runs without a Python frame
            for idx in np.flatnonzero(dones) if np.count_nonzero(dones) else ():
                episodes += 1
                self._episode_num += 1
                if action_noise is not None:
                    if n_envs > 1:
                        action_noise.reset(indices=[int(idx)])  # type: ignore[call-arg]
                    else:
                        action_noise.reset()
                if log_interval is not None and self._episode_num % log_interval == 0:
                    self.dump_logs()
        callback.on_rollout_end()
        return RolloutReturn(steps * n_envs, episodes, continue_training=True)

    def _store_transition(
        self,
        replay_buffer: ReplayBuffer,
        buffer_action: np.ndarray,
        new_obs: np.ndarray | dict[str, np.ndarray],
        reward: np.ndarray,
        dones: np.ndarray,
        infos: list[dict[str, Any]],
    ) -> None:
        if not copies_on_add(replay_buffer):
            # a buffer that may keep references to what it is given gets stock's deep copies
            super()._store_transition(replay_buffer, buffer_action, new_obs, reward, dones, infos)
            return
        store_transition(self, replay_buffer, buffer_action, new_obs, reward, dones, infos)
