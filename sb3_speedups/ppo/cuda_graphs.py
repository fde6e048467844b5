"""
PPO epochs replayed from a recorded CUDA graph.

A small network's minibatch update is about a hundred tiny kernels, and on a GPU each costs a few microseconds of
host time to launch, more than the GPU spends running it (an op-by-op update on a GPU can be slower than on one CPU
core). :class:`GraphedEpochs` records one epoch (the gather of the rollout in the epoch's order, the advantage
normalisation and every minibatch update of ``PPO.train()``'s loop) once, and replays it for every later epoch of
every rollout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch as th

from sb3_speedups.common.on_policy.ppo_loss import STATS, PPOLossConfig
from sb3_speedups.ppo.minibatches import MinibatchSampler
from sb3_speedups.ppo.update import HandDerivedPPOUpdate


def graph_key(updater: HandDerivedPPOUpdate, sampler: MinibatchSampler, cfg: PPOLossConfig) -> tuple:
    """
    :return: what a recorded epoch depends on besides the numbers read from device tensors: the objects and the
        addresses of their buffers, and the loss's and Adam's constant coefficients
    """
    group = updater.adam.optimizer.param_groups[0]
    return (
        id(updater), id(sampler), sampler.buffer_addresses(), sampler.single, sampler.normalize,
        cfg.clip_range_vf is None, cfg.ent_coef, cfg.vf_coef, cfg.max_grad_norm, tuple(group["betas"]), group["eps"],
    )  # fmt: skip


class GraphedEpochs:
    """
    Runs PPO epochs of a :class:`HandDerivedPPOUpdate` on a CUDA device: the first one op by op (it also warms up the
    libraries, as recording needs), every later one as one replay of the graph recorded after it.

    The clip ranges and the learning rate, which schedules change, are read from the updater's device scalars
    (:meth:`HandDerivedPPOUpdate.set_device_scalars`); everything in :func:`graph_key` must stay as it was recorded.

    :param updater: the update (its policy on a CUDA device)
    :param sampler: the rollout sampler on the same device
    """

    def __init__(self, updater: HandDerivedPPOUpdate, sampler: MinibatchSampler) -> None:
        self.key: tuple | None = None  # graph_key() once the first epoch has made the epoch buffers
        self.updater, self.sampler = updater, sampler
        self.device = sampler.device
        with th.inference_mode(False):
            self.stats = th.empty(sampler.n_minibatches(), len(STATS), device=self.device)
        #: the epoch's stats rows (views made once), for the minibatch updates to write into
        self.rows = list(self.stats.unbind(0))
        self.graph: th.cuda.CUDAGraph | None = None
        self.failed: str | None = None

    def run_epoch(self, cfg: PPOLossConfig, minibatch_updates: Callable[[], object]) -> th.Tensor:
        """
        Draw the epoch's order and run the epoch.

        :param cfg: the loss's coefficients (the constant ones as recorded)
        :param minibatch_updates: runs the epoch's minibatch updates op by op, writing their statistics into
            :attr:`rows` (recorded once, then replayed)
        :return: the epoch's statistics, ``[minibatches, len(STATS)]`` (overwritten by the next epoch)
        """
        sampler = self.sampler
        must_gather = sampler.draw()
        if self.graph is not None:
            if sampler.single and must_gather:
                sampler.gather()  # a single minibatch is gathered once per rollout, outside the graph
            self.graph.replay()
            return self.stats
        current = th.cuda.current_stream(self.device)
        side = th.cuda.Stream(self.device)
        side.wait_stream(current)
        with th.cuda.stream(side):
            if must_gather:
                sampler.gather()
            minibatch_updates()
        current.wait_stream(side)
        self.key = graph_key(self.updater, sampler, cfg)  # with the epoch buffers the first gather made
        if self.failed is None:
            self._record(minibatch_updates)
        return self.stats

    def _record(self, minibatch_updates: Callable[[], object]) -> None:
        graph = th.cuda.CUDAGraph()
        try:
            with th.cuda.graph(graph):
                if not self.sampler.single:
                    self.sampler.gather()
                minibatch_updates()
        except Exception as exc:  # an op that cannot be recorded: keep running op by op
            self.failed = f"{type(exc).__name__}: {exc}".splitlines()[0]
            warnings.warn(f"sb3_speedups PPO: CUDA graph recording failed, training op by op ({self.failed})", stacklevel=3)
            return
        self.graph = graph
