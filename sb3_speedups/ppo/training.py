"""
PPO's update engine, shared by :class:`sb3_speedups.PPO` and :class:`sb3_speedups.MaskablePPO`: the epochs of
minibatch updates of ``train()`` over a rollout loaded once (:class:`~sb3_speedups.ppo.minibatches.MinibatchSampler`),
driven for every updater (hand-derived, autograd, split over two processes, replayed from a CUDA graph), with stock's
loss, minibatches, ``target_kl`` and logs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.utils import obs_as_tensor

from sb3_speedups.common.on_policy.base import FastOnPolicy, OnPolicySpeedups
from sb3_speedups.common.on_policy.buffers import FastRolloutBase
from sb3_speedups.common.on_policy.ppo_loss import STATS, PPOLossConfig, kl_stops, record_train_stats, start_train
from sb3_speedups.ppo.cuda_graphs import GraphedEpochs, graph_key
from sb3_speedups.ppo.minibatches import Minibatch, MinibatchSampler
from sb3_speedups.ppo.split_update import SplitPPOUpdate, split_unsupported_reason
from sb3_speedups.ppo.update import AutogradPPOUpdate, HandDerivedPPOUpdate

#: ``normalize_advantage``'s accepted values -> the sampler's normalisation
ADVANTAGE_NORMALIZATION = {True: "minibatch", "minibatch": "minibatch", "batch": "batch", False: None, None: None}
# Observations larger than this (bytes per sample) are gathered per minibatch, not copied once per epoch.
_EPOCH_GATHER_LIMIT = 4096


@dataclass
class PPOSpeedups(OnPolicySpeedups):
    """PPO's speed-only state: its updater (hand-derived, split or autograd), frozen actor, sampler and graphs."""

    updater: HandDerivedPPOUpdate | AutogradPPOUpdate
    sampler: MinibatchSampler | None = None
    graphs: GraphedEpochs | None = None


class PPOTraining(FastOnPolicy):
    """
    Mixin: PPO's ``train()`` on the speed-only state that :meth:`_build_speedups` makes (see the module docstring).
    The class sets ``split_update``, ``recompute_advantages`` and ``cuda_graphs``; a subclass may extend
    :meth:`_load_rollout` with more per-sample inputs (MaskablePPO's masks).
    """

    #: run the critic's half of each minibatch update in a helper process: ``True``, ``False`` or ``"auto"``
    split_update: bool | str = "auto"
    #: recompute the advantages with the current value function before every epoch but the first
    recompute_advantages: bool = False
    #: on a CUDA device, replay the epochs from a CUDA graph
    cuda_graphs: bool = True
    _speedups: PPOSpeedups | None
    # set by the stock class (PPO, MaskablePPO)
    n_steps: int
    n_epochs: int
    batch_size: Any  # an int (MaskablePPO types it Optional)
    normalize_advantage: bool
    target_kl: float | None

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

    def _sampler(self, speed: PPOSpeedups) -> MinibatchSampler:
        normalize = ADVANTAGE_NORMALIZATION[self.normalize_advantage]  # type: ignore[index]
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

    def _load_rollout(self, speed: PPOSpeedups, sampler: MinibatchSampler) -> None:
        buffer = self.rollout_buffer
        assert isinstance(buffer, FastRolloutBase)
        scalars = th.stack([buffer.flat(name) for name in ("values", "log_probs", "advantages", "returns")])
        updater = speed.updater
        sampler.load(
            updater.training_observations(buffer.flat_observations()),
            updater.training_actions(buffer.flat("actions")),
            scalars,
        )

    def _recompute_advantages(self, speed: PPOSpeedups, sampler: MinibatchSampler) -> None:
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
        speed = self._ensure_speedups() if isinstance(self.rollout_buffer, FastRolloutBase) else None
        if speed is None:
            return super().train()  # type: ignore[misc]  # the stock class's
        sampler = self._sampler(speed)
        cfg = start_train(self)  # type: ignore[arg-type]  # a PPO or MaskablePPO
        self._load_rollout(speed, sampler)
        stats = th.empty(self.n_epochs * math.ceil(sampler.n / self.batch_size), len(STATS), device=self.device)
        # The hand-derived update needs no autograd: without its dispatch every op is cheaper. Its cached buffers are
        # allocated as normal tensors all the same.
        with th.inference_mode(isinstance(speed.updater, HandDerivedPPOUpdate)):
            rows, last_epoch_start = self._run_epochs(speed, sampler, cfg, stats)
        record_train_stats(self, stats[:rows], last_epoch_start, cfg)  # type: ignore[arg-type]

    def _run_epochs(
        self, speed: PPOSpeedups, sampler: MinibatchSampler, cfg: PPOLossConfig, stats: th.Tensor
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
            if kl_stops(self, row, epoch):  # type: ignore[arg-type]
                return done, True
            updater.backward()
            updater.optimizer_step(cfg.max_grad_norm)
            if interrupted:
                return done, True
        return done, False

    def _graphed_epochs(self, speed: PPOSpeedups, sampler: MinibatchSampler, cfg: PPOLossConfig) -> GraphedEpochs | None:
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
