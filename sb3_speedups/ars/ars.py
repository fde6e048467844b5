"""
ARS as in sb3-contrib, faster. Stock evaluates the ``2 * n_delta`` candidates of an iteration one after the other,
one ``predict`` call per step; here every candidate runs at once (:mod:`sb3_speedups.ars.evaluation`): their envs in
one VecEnv, their policies as one stacked network, one batched product per step. The update (``_do_one_update``),
the statistics and the defaults are stock's; only which env runs which episode, and so the envs' random draws, differ.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import sb3_contrib
import torch as th
from sb3_contrib.ars.policies import ARSPolicy
from sb3_contrib.common.vec_env.async_eval import AsyncEval
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.ars.candidates import EnvRecipe, env_recipe, is_monitor_wrapped, make_candidate_env
from sb3_speedups.ars.evaluation import (
    CandidateEpisodes,
    ObsNormalization,
    StackedCandidates,
    evaluate_together,
    stacked_policy_unsupported_reason,
)
from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.errors import UserTypeError, UserValueError


@dataclass
class ARSSpeedups:
    """ARS's speed-only state: the stacked candidates and the candidates' VecEnv (never saved)."""

    policies: StackedCandidates
    #: the training env this state was made for (rebuilt when ``set_env`` replaces it)
    training_env: VecEnv
    #: the candidates' VecEnv, or ``None``: the candidates run one after the other on the training env
    env: VecEnv | None
    #: why the candidates run on the training env (``None`` where they run together)
    sequential_reason: str | None
    monitor: bool
    normalization: ObsNormalization | None
    #: ``env`` was closed at the end of a ``learn()`` call (the next evaluation makes the state again)
    env_closed: bool = False


class ARS(FastModel, sb3_contrib.ARS):
    """
    Augmented Random Search, a drop-in for :class:`sb3_contrib.ARS` (same arguments, ``learn``, ``predict``,
    callbacks, logs and saved files); see :class:`sb3_contrib.ARS` for every argument not listed here.

    The candidates of an iteration are evaluated together, in a VecEnv of their own with ``envs_per_candidate`` envs
    per candidate: by default envs made as the training env's first env was made (its ``gym.make`` spec with the
    wrappers recorded in it, SB3's ``Monitor`` at its place, no render mode) in a :class:`BatchedSubprocVecEnv` that
    steps them all in this process, and only those whose candidate still needs episodes; ``candidate_vec_env_kwargs``
    (e.g. ``dict(n_local="auto")`` for worker processes), ``candidate_vec_env_cls`` (``DummyVecEnv``, ``RayVecEnv`` to
    spread them over a cluster; VecEnvs that cannot step a subset of their envs step them all until the last candidate
    is done, the extra steps not counted) choose another vectorisation, ``candidate_env`` builds the VecEnv yourself. The
    training env's ``VecNormalize`` statistics normalise the candidates' observations and are updated with them, as
    stock's evaluation on the training env does. Where the envs cannot be replicated (an env not made by
    ``gym.make``, a wrapper that does not record its arguments, a VecEnv wrapper other than ``VecNormalize`` /
    ``VecMonitor``) the candidates run one after the other on the training env, as stock's do (still acting without
    ``predict``'s overheads). Non-MLP policies, non-``Box`` observations and ``async_eval`` take stock's evaluation.

    Each candidate's return is the sum of its ``n_eval_episodes`` episodes' returns (plus ``alive_bonus_offset`` per
    step), timesteps and callbacks are counted as stock counts them, and the update is stock's (its code, its draws of
    the perturbations). Stock's episodes start from the training env's resets, one candidate after the other; ours
    from the resets of the candidates' own envs (seeded with the model's seed), so the envs' random draws differ.
    The candidates' VecEnv lives for one ``learn()`` call. The candidate env options are not saved: pass them again to
    ``load`` if they are not the defaults.

    :param envs_per_candidate: envs each candidate runs its ``n_eval_episodes`` episodes on, at most
        ``n_eval_episodes`` (env ``j`` runs ``(n_eval_episodes + j) // envs_per_candidate``, as ``evaluate_policy``)
    :param candidate_env: ``candidate_env(n_envs)`` returns the candidates' VecEnv (not wrapped in ``VecNormalize``;
        the model closes it); default: made from the training env's spec
    :param candidate_vec_env_cls: the VecEnv class of the default candidates' envs (default ``BatchedSubprocVecEnv``)
    :param candidate_vec_env_kwargs: its further keyword arguments
    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    """

    speed_only_attributes: ClassVar[tuple[str, ...]] = (
        *FastModel.speed_only_attributes,
        "candidate_env",
        "candidate_vec_env_cls",
        "candidate_vec_env_kwargs",
    )

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        envs_per_candidate: int = 1,
        candidate_env: Callable[[int], VecEnv] | None = None,
        candidate_vec_env_cls: type[VecEnv] | None = None,
        candidate_vec_env_kwargs: dict[str, Any] | None = None,
        num_threads: int | None = None,
        **kwargs: Any,
    ) -> None:
        if candidate_env is not None and not callable(candidate_env):
            raise UserTypeError(f"candidate_env must be a function n_envs -> VecEnv, got {type(candidate_env).__name__}")
        if candidate_env is not None and (candidate_vec_env_cls is not None or candidate_vec_env_kwargs):
            raise UserValueError("give candidate_env or candidate_vec_env_cls/_kwargs, not both (the factory builds it)")
        self.envs_per_candidate = envs_per_candidate
        self.candidate_env = candidate_env
        self.candidate_vec_env_cls = candidate_vec_env_cls
        self.candidate_vec_env_kwargs = candidate_vec_env_kwargs
        self.num_threads = num_threads
        super().__init__(policy, env, **kwargs)
        if not (isinstance(envs_per_candidate, int) and 1 <= envs_per_candidate <= max(1, self.n_eval_episodes)):
            raise UserValueError(
                f"envs_per_candidate must be an integer in [1, n_eval_episodes={self.n_eval_episodes}], "
                f"got {envs_per_candidate!r}"
            )

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        assert isinstance(self.policy, ARSPolicy)
        return stacked_policy_unsupported_reason(self.policy)

    def _close_speedups(self) -> None:
        speed = self._speedups
        self._speedups = None
        if isinstance(speed, ARSSpeedups) and speed.env is not None and not speed.env_closed:
            speed.env.close()

    def learn(self, *args: Any, **kwargs: Any) -> Any:
        """sb3-contrib's ``learn``; the candidates' VecEnv (its processes, its shared memory) is closed when it ends."""
        try:
            return super().learn(*args, **kwargs)
        finally:
            speed = self._speedups
            if isinstance(speed, ARSSpeedups) and speed.env is not None and not speed.env_closed:
                speed.env.close()
                speed.env_closed = True

    def _ensure_speedups(self) -> ARSSpeedups:
        speed = self._speedups
        assert self.env is not None
        if (
            isinstance(speed, ARSSpeedups)
            and speed.training_env is self.env
            and speed.policies.policy is self.policy
            and not speed.env_closed
        ):
            return speed
        self._close_speedups()
        recipe: EnvRecipe | str | None = None if self.candidate_env is not None else env_recipe(self.env)
        if isinstance(recipe, str):
            env, monitor, normalization = None, is_monitor_wrapped(self.env), None
            if self.verbose >= 1:
                print(f"sb3_speedups ARS: candidates evaluated one after the other on the training env ({recipe})")
        else:
            n_envs = self.pop_size * self.envs_per_candidate
            env = make_candidate_env(
                n_envs, self.env, recipe, self.candidate_env, self.candidate_vec_env_cls, self.candidate_vec_env_kwargs
            )
            if self.seed is not None:
                # a later learn() call makes the envs again: its episodes start from other resets than the first's
                env.seed(self.seed + self._n_updates)
            monitor = is_monitor_wrapped(env)
            vec_normalize = self._vec_normalize_env
            normalization = None if vec_normalize is None else ObsNormalization(vec_normalize, n_envs)
        assert isinstance(self.policy, ARSPolicy)
        speed = ARSSpeedups(
            StackedCandidates(self.policy),
            self.env,
            env,
            recipe if isinstance(recipe, str) else None,
            monitor,
            normalization,
        )
        self._speedups = speed
        return speed

    # ----- evaluation ---------------------------------------------------------------------------------------------

    def evaluate_candidates(
        self, candidate_weights: th.Tensor, callback: BaseCallback, async_eval: AsyncEval | None
    ) -> th.Tensor:
        """
        Evaluate each candidate: all at once in the candidates' VecEnv (else one after the other on the training env).

        :param candidate_weights: ``[2 * n_delta, n_params]``, the candidates' weights
        :param callback: called at each counted env step, as stock calls it
        :param async_eval: stock's multiprocess evaluation (then stock's code runs)
        :return: each candidate's return
        """
        if async_eval is not None or self.fast_path_unsupported_reason() is not None:
            return super().evaluate_candidates(candidate_weights, callback, async_eval)
        speed = self._ensure_speedups()
        assert self.env is not None
        n_envs = self.env.num_envs
        on_step = callback.on_step

        def on_steps(n_counted: int) -> None:
            # Stock's evaluate_policy calls back once per counted env and adds the training env's num_envs each time.
            for _ in range(n_counted):
                self.num_timesteps += n_envs
                on_step()

        # Only this iteration's episodes in the logs, as stock
        self.ep_info_buffer = []  # type: ignore[assignment]
        callback.on_rollout_start()
        if speed.env is not None:
            speed.policies.load(candidate_weights)
            episodes = evaluate_together(
                speed.env,
                speed.policies,
                self.n_eval_episodes,
                self.envs_per_candidate,
                speed.monitor,
                speed.normalization,
                on_steps,
            )
        else:
            episodes = CandidateEpisodes([], [])
            for index in range(self.pop_size):
                speed.policies.load(candidate_weights[index : index + 1])
                one = evaluate_together(self.env, speed.policies, self.n_eval_episodes, n_envs, speed.monitor, None, on_steps)
                episodes.rewards += one.rewards
                episodes.lengths += one.lengths
        candidate_returns = th.zeros(self.pop_size, device=self.device)
        for index, (rewards, lengths) in enumerate(zip(episodes.rewards, episodes.lengths, strict=True)):
            candidate_returns[index] = sum(rewards) + self.alive_bonus_offset * sum(lengths)
            self._mimic_monitor_wrapper(rewards, lengths)  # type: ignore[arg-type]
        callback.on_rollout_end()
        return candidate_returns
