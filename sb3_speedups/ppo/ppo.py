"""
PPO as in Stable-Baselines3, faster. What differs from stock, and why it is faster:

- collection acts from a frozen plain-tensor copy of the policy (:mod:`sb3_speedups.common.acting.actors`), synced once
  per rollout, one batched call per vectorised step, into a buffer allocated once
  (:class:`~sb3_speedups.common.on_policy.buffers.FastRolloutBuffer`);
- ``train()`` (:class:`~sb3_speedups.ppo.training.PPOTraining`, shared with MaskablePPO) shuffles once per epoch
  (:class:`~sb3_speedups.ppo.minibatches.MinibatchSampler`), keeps the statistics on the device until the end, and
  updates with :class:`~sb3_speedups.ppo.update.HandDerivedPPOUpdate` (hand-derived gradients, flat buffers, fused
  Adam) for MLP policies, else with the autograd :class:`~sb3_speedups.ppo.update.AutogradPPOUpdate`; with
  ``split_update`` the critic's half of every minibatch update runs beside the actor's in a forked helper process
  (:mod:`sb3_speedups.ppo.split_update`, plugged into the one epoch loop of ``train()`` through
  :class:`~sb3_speedups.ppo.update.TrainHooks`), and on a CUDA device the epochs are replayed from a CUDA graph
  (:class:`~sb3_speedups.ppo.cuda_graphs.GraphedEpochs`, through ``_graphed_epochs``);
- torch runs on one CPU thread unless the user chose otherwise (faster and steadier for small networks).

The maths and the defaults are stock SB3's; new options (``recompute_advantages``, ``normalize_advantage="batch"``,
schedules for ``gamma``/``gae_lambda``) are opt-in.
"""

from __future__ import annotations

from typing import Any, TypeVar

import stable_baselines3
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import FloatSchedule
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.acting.actors import FrozenActorCritic, ModuleActorCritic
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.nn.optim import adam_unsupported_reason
from sb3_speedups.common.on_policy.buffers import FastRolloutBase
from sb3_speedups.common.on_policy.collection import (
    collect_rollout,
    collect_rollout_double_buffered,
    double_buffer_unsupported_reason,
)
from sb3_speedups.common.on_policy.fast_paths import mlp_model_unsupported_reason
from sb3_speedups.errors import UserValueError
from sb3_speedups.ppo.split_update import SplitPPOUpdate
from sb3_speedups.ppo.training import ADVANTAGE_NORMALIZATION, PPOSpeedups, PPOTraining
from sb3_speedups.ppo.update import AutogradPPOUpdate, HandDerivedPPOUpdate

SelfPPO = TypeVar("SelfPPO", bound="PPO")


class PPO(PPOTraining, stable_baselines3.PPO):
    """
    Proximal Policy Optimization, a drop-in for :class:`stable_baselines3.PPO` (same arguments, ``learn``,
    ``predict``, saved files); see :class:`stable_baselines3.PPO` for every argument not listed here.

    :param gamma: discount factor, or a schedule of the remaining progress (evaluated once per rollout)
    :param gae_lambda: GAE's lambda, or a schedule of the remaining progress (evaluated once per rollout)
    :param normalize_advantage: ``True``/``"minibatch"`` (stock: per minibatch), ``"batch"`` (once over the whole
        rollout) or ``False``
    :param recompute_advantages: recompute the advantages with the current value function before every epoch but
        the first (Andrychowicz et al. 2021, "What Matters in On-Policy RL"); the value clipping still uses the
        rollout's values
    :param num_threads: torch CPU threads; ``None`` keeps a value the user set, else uses the package default (1)
    :param inference_device: where collection acts, from a copy of the policy synced once per rollout (with a GPU
        ``device``: training on the GPU, acting on the CPU); ``"auto"`` acts on the training device
    :param fast_update: use the hand-derived update for MLP policies (``False`` forces the autograd update)
    :param compile_loss: ``torch.compile`` the autograd update's loss (it only pays on long runs)
    :param cuda_graphs: on a CUDA ``device``, record an epoch of the hand-derived update as a CUDA graph and replay
        it for the later epochs (not with ``target_kl``, which needs the host after every minibatch)
    :param double_buffer: collect with the envs in two halves that step in turn, the policy acting for one half while
        the other steps (:func:`~sb3_speedups.common.on_policy.collection.collect_rollout_double_buffered`); needs a
        :class:`~sb3_speedups.BatchedSubprocVecEnv` training env with at least two groups of envs
    :param split_update: compute the critic's half of every minibatch update in a forked helper process, beside the
        actor's (:mod:`sb3_speedups.ppo.split_update`; the same numbers as one process). ``"auto"`` does so for
        the hand-derived update on a CPU with at least 2 cores when torch runs on one thread; ``True`` whenever the
        hand-derived update runs on the CPU under Linux; ``False`` never
    """

    def __init__(
        self,
        policy: Any,
        env: Any,
        *,
        gamma: float | Any = 0.99,
        gae_lambda: float | Any = 0.95,
        normalize_advantage: bool | str = True,
        recompute_advantages: bool = False,
        compile_loss: bool = False,
        cuda_graphs: bool = True,
        double_buffer: bool = False,
        split_update: bool | str = "auto",
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        if normalize_advantage not in ADVANTAGE_NORMALIZATION:
            raise UserValueError(
                f"normalize_advantage={normalize_advantage!r} is invalid: use True, False, 'minibatch' or 'batch'"
            )
        if split_update not in (True, False, "auto"):
            raise UserValueError(f"split_update={split_update!r} is invalid: use True, False or 'auto'")
        self._gamma_schedule = FloatSchedule(gamma) if callable(gamma) else None
        self._gae_lambda_schedule = FloatSchedule(gae_lambda) if callable(gae_lambda) else None
        super().__init__(
            policy,
            env,
            gamma=float(gamma(1.0)) if callable(gamma) else gamma,
            gae_lambda=float(gae_lambda(1.0)) if callable(gae_lambda) else gae_lambda,
            normalize_advantage=normalize_advantage,
            _init_setup_model=False,
            **kwargs,
        )
        self.recompute_advantages = recompute_advantages
        self.compile_loss = compile_loss
        self.cuda_graphs = cuda_graphs
        self.double_buffer = double_buffer
        self.split_update = split_update
        if _init_setup_model:
            self._setup_model()

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        reason = mlp_model_unsupported_reason(self)
        return reason or adam_unsupported_reason(self.policy.optimizer, list(self.policy.parameters()))

    def _build_speedups(self, reason: str | None) -> PPOSpeedups:
        if reason is None:
            head = make_head(self.policy.action_dist, self.action_space)
            assert head is not None
            split = self.split_update_unsupported_reason() is None
            updater: HandDerivedPPOUpdate | AutogradPPOUpdate = (
                SplitPPOUpdate(self.policy, head) if split else HandDerivedPPOUpdate(self.policy, head)
            )
            actor: FrozenActorCritic | ModuleActorCritic = FrozenActorCritic(self.policy, head, self._inference_device())
        else:
            updater = AutogradPPOUpdate(self.policy, compile_loss=self.compile_loss)
            actor = ModuleActorCritic(self.policy, self._inference_device())
            if self.verbose >= 1:
                print(f"sb3_speedups PPO: using the autograd update ({reason})")
        return PPOSpeedups(updater, actor, reason)

    # ----- collection ---------------------------------------------------------------------------------------------

    def collect_rollouts(
        self, env: VecEnv, callback: BaseCallback, rollout_buffer: RolloutBuffer, n_rollout_steps: int
    ) -> bool:
        if not isinstance(rollout_buffer, FastRolloutBase):
            if self.double_buffer:
                raise UserValueError(
                    f"double_buffer=True needs the default rollout buffer, not {type(rollout_buffer).__name__}"
                )
            return super().collect_rollouts(env, callback, rollout_buffer, n_rollout_steps)
        reason = double_buffer_unsupported_reason(self, env) if self.double_buffer else None
        if reason is not None:
            raise UserValueError(reason)
        speed = self._synced_speedups(rollout_buffer)
        progress = self._current_progress_remaining
        if self._gamma_schedule is not None:
            self.gamma = float(self._gamma_schedule(progress))
        if self._gae_lambda_schedule is not None:
            self.gae_lambda = float(self._gae_lambda_schedule(progress))
        rollout_buffer.gamma, rollout_buffer.gae_lambda = self.gamma, self.gae_lambda
        collect = collect_rollout_double_buffered if self.double_buffer else collect_rollout
        return collect(self, env, callback, rollout_buffer, n_rollout_steps, speed.actor, self.gamma)
