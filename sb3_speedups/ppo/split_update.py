"""
PPO's minibatch update on two CPU cores: the actor's half in the training process, the critic's half in a forked
helper process, side by side.

With separate policy and value networks (SB3's default for ``MlpPolicy``) the two halves of the loss touch disjoint
parameters: the clipped surrogate and the entropy only the actor's, the value loss only the critic's. Only the
gradient clipping couples them (one norm over all gradients). So each minibatch runs as: the helper computes the
critic's forward and backward while the training process computes the actor's; the training process then takes the
norm of the whole gradient (the same reduction over the same buffer as in one process), and each process takes the
Adam step of its own parameters (element-wise, so the same numbers). Parameters, gradients and Adam moments live in
shared memory (:func:`~sb3_speedups.common.nn.flat.shared_zeros`); the processes hand over work through a command
ring (:mod:`sb3_speedups.ppo.helper_process`, which also says how the helper lives and dies).
"""

from __future__ import annotations

import math
import os
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.common.nn.flat import shared_zeros
from sb3_speedups.common.on_policy.ppo_loss import VALUE_LOSS, PPOLossConfig
from sb3_speedups.common.torch_utils import available_cpus
from sb3_speedups.ppo.helper_process import CommandChannel, HelperError, HelperProcess, deferred_sigint
from sb3_speedups.ppo.minibatches import OLD_VALUES, RETURNS, Minibatch, MinibatchSampler
from sb3_speedups.ppo.update import HandDerivedPPOUpdate

__all__ = ["HelperError", "SplitPPOUpdate", "deferred_sigint", "split_unsupported_reason"]

_LOAD, _GATHER, _GRAD, _STEP = 1, 2, 3, 4  # the helper's commands


def split_unsupported_reason(policy: ActorCriticPolicy, explicit: bool) -> str | None:
    """
    :param policy: a policy the hand-derived update runs
    :param explicit: ``split_update=True`` (the CPU count and torch's thread count are not checked then)
    :return: why the update cannot run split over two processes here, or ``None`` when it can
    """
    if not hasattr(os, "fork") or not sys.platform.startswith("linux"):
        return "split updates need Linux's fork()"
    if policy.device.type != "cpu":
        return "split updates run on the CPU"
    if explicit:
        return None
    if available_cpus() < 2:
        return "fewer than 2 CPUs"
    if th.get_num_threads() != 1:
        return "torch runs on several threads"
    return None


class _Shared:
    """The shared-memory areas of one helper, sized for one rollout shape."""

    def __init__(self, n: int, obs_dim: int, capacity: int, dtype: th.dtype) -> None:
        self.n, self.obs_dim, self.capacity = n, obs_dim, capacity
        self.channel = CommandChannel.allocate()
        self.results = shared_zeros(capacity, th.float64).numpy()
        self.obs = shared_zeros(n * obs_dim, dtype).view(n, obs_dim)  # the networks' input: float rows or one-hot columns
        self.scalars = shared_zeros(2 * n).view(2, n)  # old values, returns
        self.index = shared_zeros(n, th.int64)


@dataclass
class _CriticViews:
    """The helper's views of one minibatch of the gathered epoch, made once per ``start:end``."""

    obs: th.Tensor
    old_values: th.Tensor
    returns: th.Tensor


@dataclass
class _Epoch:
    """The helper's copy of the epoch's data, gathered in the epoch's order."""

    obs: th.Tensor
    #: ``[2, n]``: old values, returns
    scalars: th.Tensor


class SplitPPOUpdate(HandDerivedPPOUpdate):
    """
    :class:`~sb3_speedups.ppo.update.HandDerivedPPOUpdate` with the critic's half of every minibatch
    (:meth:`~sb3_speedups.ppo.update.HandDerivedPPOUpdate.critic_loss`) computed in a forked helper process (see the
    module's docstring). The same numbers as the one-process update of unstacked networks. ``PPO.train()`` drives
    it through its :class:`~sb3_speedups.ppo.update.TrainHooks`.

    :param policy: as for :class:`HandDerivedPPOUpdate`
    :param head: the policy's action head
    """

    minibatch_hook = True

    def __init__(self, policy: ActorCriticPolicy, head: ActionHead) -> None:
        super().__init__(policy, head, split=True)
        self.actor_part = slice(0, self.net.critic_start)
        self.critic_part = slice(self.net.critic_start, self.flat.data.numel())
        self._helper: HelperProcess | None = None
        self._shared: _Shared | None = None
        self._last_gather = 0  # the command count at which the helper has read the last order handed to it
        # helper side
        self._epoch: _Epoch | None = None
        self._views: dict[tuple[int, int], _CriticViews] = {}
        self._cfg: PPOLossConfig | None = None

    # ----- training process ---------------------------------------------------------------------------------------

    def train_guard(self) -> AbstractContextManager[list[int]]:
        """Ctrl-C waits for the end of a minibatch (:func:`deferred_sigint`): never between the two halves."""
        return deferred_sigint()

    def begin_train(self, sampler: MinibatchSampler, cfg: PPOLossConfig, max_rows: int) -> None:
        """Start the helper if needed and hand it the rollout (observations, old values and returns)."""
        observations, scalars = sampler.observations, sampler.scalars
        assert isinstance(observations, th.Tensor)
        n, obs_dim = observations.shape
        helper, shared = self._helper, self._shared
        fits = (
            shared is not None
            and (shared.n, shared.obs_dim, shared.obs.dtype) == (n, obs_dim, observations.dtype)
            and shared.capacity >= max_rows
        )
        if helper is None or shared is None or not fits or not helper.alive():
            self.close()
            shared = self._shared = _Shared(n, obs_dim, max(max_rows, 1), observations.dtype)
            helper = self._helper = HelperProcess(partial(self.serve_command, shared=shared), shared.channel)
            self._last_gather = 0
        shared.obs.copy_(observations)
        shared.scalars[0].copy_(scalars[OLD_VALUES])
        shared.scalars[1].copy_(scalars[RETURNS])
        clip_vf = math.nan if cfg.clip_range_vf is None else cfg.clip_range_vf
        helper.post(_LOAD, cfg.clip_range, clip_vf, cfg.ent_coef, cfg.vf_coef, cfg.max_grad_norm, wake=True)
        self._adam_step = float(self.adam.steps[0])
        self._hyperparameters = self.adam.hyperparameters()  # nothing changes them during a train()

    def gathered(self, index: th.Tensor) -> None:
        """Tell the helper that the sampler gathered the epoch in the order ``index``."""
        assert self._helper is not None and self._shared is not None
        self._helper.wait(self._last_gather)  # done long ago in practice: no wait for the helper to wake up
        self._shared.index.copy_(index)
        self._last_gather = self._helper.post(_GATHER)

    def begin_minibatch(self, mb: Minibatch, row: int) -> None:
        """Have the helper compute the critic's gradient of the minibatch (its value loss goes to stats row ``row``)."""
        assert self._helper is not None
        self._helper.post(_GRAD, mb.start, mb.end, row)

    def forward(self, mb: Minibatch, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """The actor's half of :meth:`HandDerivedPPOUpdate.forward` (the value loss's statistic comes at :meth:`end_train`)."""
        obs = mb.observations
        assert isinstance(obs, th.Tensor)
        ws = self._ws.get(obs.shape[0]) or self.workspace(obs.shape[0], obs.device)
        self.actor_loss(ws, mb, cfg, self.net.forward_part(obs, 0))
        self.write_stats(ws, cfg, stats)

    def backward(self) -> None:
        """The actor's gradient (the critic's is the helper's)."""
        ws = self._pending
        assert ws is not None
        self.net.backward_part(self.actor_output_gradient(ws, self._pending_ent_coef), 0)

    def optimizer_step(self, max_grad_norm: float) -> None:
        """Wait for the critic's gradient, clip by the norm of both, and step the actor here and the critic there."""
        helper = self._helper
        assert helper is not None
        helper.idle()
        divisor = self.flat.clip_divisor(max_grad_norm)
        lr, beta1, beta2, eps = self._hyperparameters
        self._adam_step += 1
        helper.post(_STEP, 0.0 if divisor is None else float(divisor), lr, beta1, beta2, eps, self._adam_step)
        self.adam.step_range(self.actor_part, divisor, lr, beta1, beta2, eps, self._adam_step)

    def end_train(self, stats: th.Tensor, rows: int) -> None:
        """Wait for the helper's last step and put its value losses into ``stats[:rows]``."""
        assert self._helper is not None and self._shared is not None
        self._helper.idle()
        self._helper.check()
        stats[:rows, VALUE_LOSS].copy_(th.from_numpy(self._shared.results[:rows]))

    def abandon(self) -> None:
        """After an error mid-train: stop the helper (a fresh one starts with the next ``train()``)."""
        self.close()

    def close(self) -> None:
        """Stop the helper process, if any."""
        if self._helper is not None:
            self._helper.stop()
            self._helper = self._shared = None

    def helper_pid(self) -> int | None:
        """:return: the helper process's pid while it runs"""
        return None if self._helper is None else self._helper.pid

    # ----- helper process -----------------------------------------------------------------------------------------

    def serve_command(self, code: int, args: np.ndarray, shared: _Shared) -> None:
        """Run one command in the helper process (``args[1:]`` holds the command's arguments)."""
        if code == _GRAD:
            self._critic_gradient(int(args[1]), int(args[2]), int(args[3]), shared)
        elif code == _STEP:
            divisor = float(args[1])
            grad_divisor = None if divisor == 0.0 else self.flat.divisor_tensor(divisor)
            self.adam.step_range(
                self.critic_part, grad_divisor, float(args[2]), float(args[3]), float(args[4]), float(args[5]), float(args[6])
            )
        elif code == _GATHER:
            if self._epoch is None:
                self._epoch = _Epoch(th.empty_like(shared.obs), th.empty_like(shared.scalars))
            th.index_select(shared.obs, 0, shared.index, out=self._epoch.obs)
            th.index_select(shared.scalars, 1, shared.index, out=self._epoch.scalars)
        elif code == _LOAD:
            clip_vf = float(args[2])
            self._cfg = PPOLossConfig(
                float(args[1]), None if math.isnan(clip_vf) else clip_vf, float(args[3]), float(args[4]), float(args[5])
            )
        else:
            raise ValueError(f"unknown command {code}")

    def _critic_gradient(self, start: int, end: int, row: int, shared: _Shared) -> None:
        assert self._epoch is not None and self._cfg is not None
        views = self._views.get((start, end))
        if views is None:
            epoch = self._epoch
            views = self._views[(start, end)] = _CriticViews(
                epoch.obs[start:end], epoch.scalars[0, start:end], epoch.scalars[1, start:end]
            )
        ws = self._ws.get(end - start) or self.workspace(end - start, views.obs.device)
        self.critic_loss(ws, self.net.forward_part(views.obs, 1), views.old_values, views.returns, self._cfg)
        shared.results[row] = float(th.dot(ws.stat_rows[VALUE_LOSS], ws.mean_weights))
        self.net.backward_part(ws.g_values, 1)
