"""
PPO as in Stable-Baselines3, faster. What differs from stock, and why it is faster:

- collection acts from a frozen plain-tensor copy of the policy (:mod:`sb3_speedups.common.acting.actors`), synced once
  per rollout, one batched call per vectorised step, into a buffer allocated once
  (:class:`~sb3_speedups.ppo.buffers.FastRolloutBuffer`);
- ``train()`` shuffles once per epoch (:class:`~sb3_speedups.ppo.minibatches.MinibatchSampler`), keeps the
  statistics on the device until the end, and updates with :class:`~sb3_speedups.ppo.update.HandDerivedPPOUpdate`
  (hand-derived gradients, flat buffers, fused Adam) for MLP policies, else with the autograd
  :class:`~sb3_speedups.ppo.update.AutogradPPOUpdate`; with ``split_update`` the critic's half of every minibatch
  update runs beside the actor's in a forked helper process (:mod:`sb3_speedups.ppo.split_update`, plugged into the
  one epoch loop of ``train()`` through :class:`~sb3_speedups.ppo.update.TrainHooks`), and on a CUDA device the
  epochs are replayed from a CUDA graph (:class:`~sb3_speedups.ppo.cuda_graphs.GraphedEpochs`, through
  ``_graphed_epochs``);
- torch runs on one CPU thread unless the user chose otherwise (faster and steadier for small networks).

The maths and the defaults are stock SB3's; new options (``recompute_advantages``, ``normalize_advantage="batch"``,
schedules for ``gamma``/``gae_lambda``) are opt-in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import numpy as np
import stable_baselines3
import torch as th
from gymnasium import spaces
from stable_baselines3.common.buffers import RolloutBuffer
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.utils import FloatSchedule, obs_as_tensor
from stable_baselines3.common.vec_env import VecEnv

from sb3_speedups.common.acting.actors import FrozenActorCritic, ModuleActorCritic
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.nn.optim import adam_unsupported_reason
from sb3_speedups.common.on_policy.fast_paths import mlp_model_unsupported_reason
from sb3_speedups.common.on_policy.ppo_loss import STATS, PPOLossConfig, kl_stops, record_train_stats, start_train
from sb3_speedups.common.fast_model import FastModel
from sb3_speedups.errors import UserValueError
from sb3_speedups.ppo.buffers import FastRolloutBase, install_fast_rollout_buffer
from sb3_speedups.ppo.collection import collect_rollout, collect_rollout_double_buffered, double_buffer_unsupported_reason
from sb3_speedups.ppo.cuda_graphs import GraphedEpochs, graph_key
from sb3_speedups.ppo.minibatches import Minibatch, MinibatchSampler
from sb3_speedups.ppo.split_update import SplitPPOUpdate, split_unsupported_reason
from sb3_speedups.ppo.update import AutogradPPOUpdate, HandDerivedPPOUpdate

SelfPPO = TypeVar("SelfPPO", bound="PPO")

_NORMALIZATION = {True: "minibatch", "minibatch": "minibatch", "batch": "batch", False: None, None: None}
# Observations larger than this (bytes per sample) are gathered per minibatch, not copied once per epoch.
_EPOCH_GATHER_LIMIT = 4096


@dataclass
class _Speedups:
    """Speed-only state, rebuilt whenever the policy's parameters or optimizer state are replaced (never saved)."""

    updater: HandDerivedPPOUpdate | AutogradPPOUpdate
    actor: FrozenActorCritic | ModuleActorCritic
    fallback_reason: str | None
    sampler: MinibatchSampler | None = None
    graphs: GraphedEpochs | None = None


class PPO(FastModel, stable_baselines3.PPO):
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
        the other steps (:func:`~sb3_speedups.ppo.collection.collect_rollout_double_buffered`); needs a
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
        num_threads: int | None = None,
        inference_device: str = "cpu",
        fast_update: bool = True,
        compile_loss: bool = False,
        cuda_graphs: bool = True,
        double_buffer: bool = False,
        split_update: bool | str = "auto",
        _init_setup_model: bool = True,
        **kwargs: Any,
    ) -> None:
        if normalize_advantage not in _NORMALIZATION:
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
            normalize_advantage=normalize_advantage,  # type: ignore[arg-type]
            _init_setup_model=False,
            **kwargs,
        )
        self.recompute_advantages = recompute_advantages
        self.num_threads = num_threads
        self.inference_device = inference_device
        self.fast_update = fast_update
        self.compile_loss = compile_loss
        self.cuda_graphs = cuda_graphs
        self.double_buffer = double_buffer
        self.split_update = split_update
        self._speedups: _Speedups | None = None
        if _init_setup_model:
            self._setup_model()

    def _after_stock_setup(self) -> None:
        install_fast_rollout_buffer(self)

    # ----- speed-only state ---------------------------------------------------------------------------------------

    def _unsupported_reason(self) -> str | None:
        reason = mlp_model_unsupported_reason(self)
        return reason or adam_unsupported_reason(self.policy.optimizer, list(self.policy.parameters()))

    def _inference_device(self) -> th.device:
        return self.device if self.inference_device == "auto" else th.device(self.inference_device)

    def _ensure_speedups(self) -> _Speedups:
        speed = self._speedups
        if speed is not None and speed.updater.policy is self.policy and speed.updater.is_bound():
            return speed
        self._close_speedups()
        reason = self.fast_path_unsupported_reason()
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
        self._speedups = _Speedups(updater, actor, reason)
        return self._speedups

    def split_update_unsupported_reason(self) -> str | None:
        """:return: why the minibatch update does not run split over two processes (``split_update``), or ``None``"""
        if self.split_update is False:
            return "split_update=False"
        if self.recompute_advantages:
            return "recompute_advantages=True (the values are recomputed between epochs)"
        return split_unsupported_reason(self.policy, explicit=self.split_update is True)

    def _close_speedups(self) -> None:
        """Stop the split update's helper process, if one runs (the speed-only state is rebuilt when needed)."""
        speed = getattr(self, "_speedups", None)
        if speed is not None and isinstance(speed.updater, SplitPPOUpdate):
            speed.updater.close()

    def _sampler(self, speed: _Speedups) -> MinibatchSampler:
        normalize = _NORMALIZATION[self.normalize_advantage]  # type: ignore[index]
        sampler = speed.sampler
        key = (self.n_steps, self.n_envs, self.batch_size, self.device, normalize)
        if sampler is None or (sampler.n_steps, sampler.n_envs, sampler.batch_size, sampler.device, sampler.normalize) != key:
            obs_bytes = sum(int(np.prod(s.shape or ())) * np.dtype(s.dtype).itemsize for s in self._observation_spaces())
            gather = (
                "epoch" if isinstance(speed.updater, HandDerivedPPOUpdate) or obs_bytes <= _EPOCH_GATHER_LIMIT else "minibatch"
            )
            sampler = speed.sampler = MinibatchSampler(*key, gather_observations=gather)
        return sampler

    def _observation_spaces(self) -> list[spaces.Space]:
        space = self.observation_space
        return list(space.spaces.values()) if isinstance(space, spaces.Dict) else [space]

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
        speed = self._ensure_speedups()
        speed.actor.sync()
        progress = self._current_progress_remaining
        if self._gamma_schedule is not None:
            self.gamma = float(self._gamma_schedule(progress))
        if self._gae_lambda_schedule is not None:
            self.gae_lambda = float(self._gae_lambda_schedule(progress))
        rollout_buffer.gamma, rollout_buffer.gae_lambda = self.gamma, self.gae_lambda
        collect = collect_rollout_double_buffered if self.double_buffer else collect_rollout
        return collect(self, env, callback, rollout_buffer, n_rollout_steps, speed.actor, self.gamma)

    # ----- update -------------------------------------------------------------------------------------------------

    def _load_rollout(self, speed: _Speedups, sampler: MinibatchSampler) -> None:
        buffer = self.rollout_buffer
        assert isinstance(buffer, FastRolloutBase)
        scalars = th.stack([buffer.flat(name) for name in ("values", "log_probs", "advantages", "returns")])
        updater = speed.updater
        sampler.load(
            updater.training_observations(buffer.flat_observations()),
            updater.training_actions(buffer.flat("actions")),
            scalars,
        )

    def _recompute_advantages(self, speed: _Speedups, sampler: MinibatchSampler) -> None:
        buffer = self.rollout_buffer
        assert isinstance(buffer, FastRolloutBase)
        updater = speed.updater

        def values_of(obs: Any) -> np.ndarray:
            return updater.predict_values(updater.training_observations(obs_as_tensor(obs, self.device))).cpu().numpy()

        values = updater.predict_values(sampler.observations).cpu().numpy().reshape(self.n_steps, self.n_envs)
        timeouts = [values_of(record.timeouts.observations) for record in buffer.timeouts]
        buffer.recompute_returns_and_advantage(values, values_of(buffer.last_observations), timeouts)
        sampler.set_targets(buffer.flat("advantages"), buffer.flat("returns"))

    def train(self) -> None:
        """Update the policy on the collected rollout: SB3's PPO loss, minus its per-minibatch overheads."""
        if not isinstance(self.rollout_buffer, FastRolloutBase):
            return super().train()
        speed = self._ensure_speedups()
        sampler = self._sampler(speed)
        cfg = start_train(self)
        self._load_rollout(speed, sampler)
        stats = th.empty(self.n_epochs * math.ceil(sampler.n / self.batch_size), len(STATS), device=self.device)
        # The hand-derived update needs no autograd: without its dispatch every op is cheaper. Its cached buffers are
        # allocated as normal tensors all the same.
        with th.inference_mode(isinstance(speed.updater, HandDerivedPPOUpdate)):
            rows, last_epoch_start = self._run_epochs(speed, sampler, cfg, stats)
        record_train_stats(self, stats[:rows], last_epoch_start, cfg)

    def _run_epochs(
        self, speed: _Speedups, sampler: MinibatchSampler, cfg: PPOLossConfig, stats: th.Tensor
    ) -> tuple[int, int]:
        """
        The epochs of minibatch updates, for every updater: what an updater adds (the split update's helper process)
        comes through its :class:`~sb3_speedups.ppo.update.TrainHooks`; with CUDA graphs an epoch is a replay.

        :return: the minibatch updates done and the index of the last epoch's first one
        """
        updater = speed.updater
        graphs = self._graphed_epochs(speed, sampler, cfg)
        begin_minibatch = updater.begin_minibatch if updater.minibatch_hook else None
        stat_rows = stats.unbind(0)  # the row views at once, not one indexing per minibatch
        rows = last_epoch_start = 0
        try:
            with updater.train_guard() as interrupted:
                updater.begin_train(sampler, cfg, stats.shape[0])
                for epoch in range(self.n_epochs):
                    if self.recompute_advantages and epoch > 0:
                        self._recompute_advantages(speed, sampler)
                    last_epoch_start = rows
                    if graphs is None:
                        if sampler.draw():
                            sampler.gather()
                            updater.gathered(sampler.index)
                        done, stop = self._minibatch_updates(
                            updater, sampler, cfg, stat_rows[rows:], rows, epoch, begin_minibatch, interrupted
                        )
                    else:
                        replayed = partial(self._minibatch_updates, updater, sampler, cfg, graphs.rows, 0, epoch)
                        epoch_stats = graphs.run_epoch(cfg, replayed)
                        done, stop = epoch_stats.shape[0], False
                        stats[rows : rows + done].copy_(epoch_stats)
                    rows += done
                    self._n_updates += 1
                    if stop:
                        break
                updater.end_train(stats, rows)
        except BaseException:
            updater.abandon()
            raise
        return rows, last_epoch_start

    def _minibatch_updates(
        self,
        updater: HandDerivedPPOUpdate | AutogradPPOUpdate,
        sampler: MinibatchSampler,
        cfg: PPOLossConfig,
        stat_rows: Sequence[th.Tensor],
        first_row: int,
        epoch: int,
        begin_minibatch: Callable[[Minibatch, int], None] | None = None,
        interrupted: Sequence[int] = (),
    ) -> tuple[int, bool]:
        """
        One epoch's minibatch updates, the statistics of the ``i``-th into ``stat_rows[i]``.

        :return: how many were done, and whether training stops (``target_kl``, or a deferred Ctrl-C)
        """
        done = 0
        for minibatch, row in zip(sampler.minibatches(), stat_rows, strict=False):
            if begin_minibatch is not None:
                begin_minibatch(minibatch, first_row + done)
            updater.forward(minibatch, cfg, row)
            done += 1
            if kl_stops(self, row, epoch):
                return done, True
            updater.backward()
            updater.optimizer_step(cfg.max_grad_norm)
            if interrupted:
                return done, True
        return done, False

    def _graphed_epochs(self, speed: _Speedups, sampler: MinibatchSampler, cfg: PPOLossConfig) -> GraphedEpochs | None:
        """
        :return: the recorded epochs to replay (the updater then reads its scheduled numbers from device scalars), or
            ``None`` to run op by op (CPU, autograd update, ``target_kl``)
        """
        updater = speed.updater
        if isinstance(updater, HandDerivedPPOUpdate):
            updater.use_host_scalars()
        if not (self.cuda_graphs and self.device.type == "cuda" and isinstance(updater, HandDerivedPPOUpdate)):
            return None
        if self.target_kl is not None or not sampler.per_epoch_obs:
            return None
        graphs = speed.graphs
        if graphs is not None and graphs.failed is not None:
            return None
        updater.set_device_scalars(cfg, float(self.policy.optimizer.param_groups[0]["lr"]))
        if graphs is None or graphs.key != graph_key(updater, sampler, cfg):
            graphs = speed.graphs = GraphedEpochs(updater, sampler)
        return graphs
