"""
One PPO minibatch update, two ways with one interface (``forward`` -> ``backward`` -> ``optimizer_step``), both
computing the loss of :mod:`sb3_speedups.common.on_policy.ppo_loss` and writing its statistics (:data:`STATS`, means over the
minibatch) into a row of a tensor without a host sync:

- :class:`HandDerivedPPOUpdate`: the standard MLP case with the loss's gradient derived by hand (no autograd graph),
  every intermediate in a preallocated buffer, gradients straight into one flat buffer, one fused Adam step. Its
  actor half (surrogate and entropy: actor parameters only) and critic half (value loss: critic parameters only) are
  separate methods, which :class:`~sb3_speedups.ppo.split_update.SplitPPOUpdate` runs in two processes.
- :class:`AutogradPPOUpdate`: any ``ActorCriticPolicy`` through autograd, with the flat fused Adam when the
  optimizer allows it, and the distribution maths of :mod:`sb3_speedups.common.nn.heads` where the policy is standard.

The loss, its hand-derived gradients and the tests that check them: see docs/maths.md, "PPO loss".

PPO's ``train()`` runs one loop for both (and for the split update and CUDA graphs); :class:`TrainHooks` is what an
update may plug into it.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.acting.actors import standard_head, policy_latents
from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.nn.optim import FlatAdam
from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp
from sb3_speedups.common.on_policy.ppo_loss import (
    CLIP_FRACTION,
    ENTROPY_LOSS,
    LOG_RATIO,
    NEG_PG,
    RATIO,
    STATS,
    VALUE_LOSS,
    PPOLossConfig,
    approx_kl,
    ppo_loss,
)
from sb3_speedups.ppo.minibatches import Minibatch, MinibatchSampler
from sb3_speedups.common.torch_utils import to_channels_last, trains_channels_last

__all__ = ["STATS", "VALUE_LOSS", "AutogradPPOUpdate", "HandDerivedPPOUpdate", "PPOLossConfig", "TrainHooks", "approx_kl"]


class TrainHooks:
    """
    What ``PPO.train()``'s epoch loop calls on an update besides ``forward``/``backward``/``optimizer_step``; all
    no-ops here. The loop resolves :meth:`begin_minibatch` once per ``train()`` (see :attr:`minibatch_hook`).
    """

    #: whether :meth:`begin_minibatch` does anything (the loop skips the call otherwise)
    minibatch_hook = False

    def train_guard(self) -> AbstractContextManager[list[int]]:
        """:return: a context around the whole ``train()``; the list it yields is non-empty once the loop must stop"""
        return nullcontext([])

    def begin_train(self, sampler: MinibatchSampler, cfg: PPOLossConfig, max_rows: int) -> None:
        """Called once the sampler holds the rollout, before the first epoch (``max_rows``: most minibatch updates)."""

    def gathered(self, index: th.Tensor) -> None:
        """Called after the sampler gathered an epoch's data in the order ``index``."""

    def begin_minibatch(self, mb: Minibatch, row: int) -> None:
        """Called before ``forward`` of the minibatch whose statistics go to row ``row`` of the ``train()``."""

    def end_train(self, stats: th.Tensor, rows: int) -> None:
        """Called after the last minibatch update; may complete ``stats[:rows]``."""

    def abandon(self) -> None:
        """Called instead of :meth:`end_train` when the ``train()`` raised."""


@dataclass
class HandDerivedWorkspace:
    """A minibatch size's per-sample buffers of :class:`HandDerivedPPOUpdate`, allocated once."""

    n: int
    #: ``[len(STATS), n]``: the per-sample terms whose means make a stats row
    rows: th.Tensor
    #: ``rows[k]`` for each statistic ``k``, views made once
    stat_rows: list[th.Tensor]
    log_prob: th.Tensor
    clipped: th.Tensor
    s1: th.Tensor
    s2: th.Tensor
    err: th.Tensor
    dv: th.Tensor
    dv_clipped: th.Tensor
    g_log_prob: th.Tensor
    mask: th.Tensor
    vmask: th.Tensor
    zeros: th.Tensor
    mean_weights: th.Tensor
    #: ``[n, 1]`` d loss / d V, and its flat view
    g_values: th.Tensor
    g_values_flat: th.Tensor
    #: the action head's own workspace
    head: Any

    @classmethod
    @th.inference_mode(False)
    def allocate(cls, n: int, device: th.device, head: ActionHead) -> HandDerivedWorkspace:
        """Normal tensors even when allocated under inference mode (train() runs there), so they work in any mode."""
        # zeros: the split update's actor process never writes the value loss's row, whose mean must then be 0
        rows = th.zeros(len(STATS), n, device=device)
        g_values = th.empty(n, 1, device=device)

        def vector() -> th.Tensor:
            return th.empty(n, device=device)

        return cls(
            n=n,
            rows=rows,
            stat_rows=list(rows),
            log_prob=vector(),
            clipped=vector(),
            s1=vector(),
            s2=vector(),
            err=vector(),
            dv=vector(),
            dv_clipped=vector(),
            g_log_prob=vector(),
            mask=vector(),
            vmask=th.empty(n, dtype=th.bool, device=device),
            zeros=th.zeros(n, device=device),
            mean_weights=th.full((n,), 1.0 / n, device=device),
            g_values=g_values,
            g_values_flat=g_values.view(-1),
            head=head.workspace(n, device),
        )


class HandDerivedPPOUpdate(TrainHooks):
    """
    Hand-derived PPO update of an MLP ``ActorCriticPolicy``; building it moves the policy's parameters into one
    flat buffer (:class:`~sb3_speedups.common.nn.flat.FlatParameters`) and its Adam state into :class:`FlatAdam`.

    :param policy: a policy accepted by :func:`~sb3_speedups.common.nn.training.mlp_unsupported_reason`, with a
        ``torch.optim.Adam`` accepted by :func:`~sb3_speedups.common.nn.optim.adam_unsupported_reason`
    :param head: the policy's action head
    :param split: lay the networks out for :class:`~sb3_speedups.ppo.split_update.SplitPPOUpdate` (actor and
        critic apart, buffers in shared memory)
    """

    def __init__(self, policy: ActorCriticPolicy, head: ActionHead, split: bool = False) -> None:
        self.policy, self.head = policy, head
        self.net = ActorCriticMlp(policy, split=split)
        self.flat = self.net.flat
        self.adam = FlatAdam(self.flat, policy.optimizer)
        self._ws: dict[int, HandDerivedWorkspace] = {}
        self._device_scalars: th.Tensor | None = None
        self._scalars: th.Tensor | None = None  # the device scalars while they are in use
        self._pending: HandDerivedWorkspace | None = None  # the last forward's, for backward
        self._pending_ent_coef = 0.0

    def set_device_scalars(self, cfg: PPOLossConfig, lr: float) -> None:
        """
        Read the clip ranges and the learning rate from a tensor on the training device from now on, and set them.

        A recorded CUDA graph keeps the numbers it was recorded with; read from a tensor, values that schedules
        change from one ``train()`` to the next reach every replay. (On the CPU, Adam then reads the learning rate as
        float32 instead of double: a last-bit difference in the step.)

        :param cfg: the loss's coefficients (``clip_range``, ``clip_range_vf`` are read)
        :param lr: the learning rate
        """
        vf = 0.0 if cfg.clip_range_vf is None else cfg.clip_range_vf
        values = th.tensor([1 - cfg.clip_range, 1 + cfg.clip_range, -vf, vf, lr], dtype=th.float32)
        if self._device_scalars is None:  # allocated once: a recorded graph reads it at its address
            with th.inference_mode(False):
                self._device_scalars = th.empty(5, dtype=th.float32, device=self.flat.data.device)
        self._scalars = self._device_scalars.copy_(values)

    def use_host_scalars(self) -> None:
        """Take the clip ranges and the learning rate from the arguments again (the op-by-op default)."""
        self._scalars = None

    def is_bound(self) -> bool:
        """:return: whether the policy's parameters and optimizer state still live in our flat buffers"""
        return self.policy.optimizer is self.adam.optimizer and self.flat.is_bound() and self.adam.is_bound()

    def training_actions(self, actions: th.Tensor) -> dict[str, th.Tensor]:
        """:return: the per-sample action tensors :meth:`forward` reads, from the stored float actions"""
        return self.head.training_actions(actions)

    def training_observations(self, observations: Any) -> th.Tensor:
        """:return: the observations as the network's input (float rows ``[N, obs_dim]``, or one-hot columns ``[N, k]``)"""
        return self.net.inputs(observations)

    def workspace(self, n: int, device: th.device) -> HandDerivedWorkspace:
        """:return: the buffers for minibatches of ``n`` samples (allocated on first use)"""
        ws = self._ws.get(n)
        if ws is None:
            ws = self._ws[n] = HandDerivedWorkspace.allocate(n, device, self.head)
        return ws

    def forward(self, mb: Minibatch, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """Write the loss's statistics into ``stats`` (a row of :data:`STATS`); keep its per-sample gradients."""
        obs = mb.observations
        assert isinstance(obs, th.Tensor)
        ws = self._ws.get(obs.shape[0]) or self.workspace(obs.shape[0], obs.device)
        out, values = self.net.forward(obs)
        self.actor_loss(ws, mb, cfg, out)
        self.critic_loss(ws, values, mb.old_values, mb.returns, cfg)
        self.write_stats(ws, cfg, stats)

    def write_stats(self, ws: HandDerivedWorkspace, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """Write the means of the per-sample terms into ``stats`` and keep ``ws`` for :meth:`backward`."""
        th.mv(ws.rows, ws.mean_weights, out=stats)  # all the means as one product: cheaper than sum and divide
        self._pending, self._pending_ent_coef = ws, cfg.ent_coef

    def actor_loss(self, ws: HandDerivedWorkspace, mb: Minibatch, cfg: PPOLossConfig, out: th.Tensor) -> None:
        """The actor's half: surrogate and entropy terms into their stats rows, ``d loss / d log_prob`` into ``ws``."""
        row = ws.stat_rows
        self.head.forward(ws.head, out, mb.actions, self.net.log_std, ws.log_prob, row[ENTROPY_LOSS])
        logratio, ratio, clipped, s1, s2 = row[LOG_RATIO], row[RATIO], ws.clipped, ws.s1, ws.s2
        th.sub(ws.log_prob, mb.old_log_prob, out=logratio)
        th.exp(logratio, out=ratio)
        th.mul(mb.advantages, ratio, out=s1)
        scalars = self._scalars
        if scalars is None:
            th.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range, out=clipped)
        else:
            th.clamp(ratio, scalars[0], scalars[1], out=clipped)
        th.mul(mb.advantages, clipped, out=s2)
        th.minimum(s1, s2, out=row[NEG_PG])
        th.ne(clipped, ratio, out=row[CLIP_FRACTION])
        th.le(s1, s2, out=ws.mask)
        th.addcmul(ws.zeros, s1, ws.mask, value=-1.0 / ws.n, out=ws.g_log_prob)

    def actor_output_gradient(self, ws: HandDerivedWorkspace, ent_coef: float) -> th.Tensor:
        """:return: ``d loss / d (actor output)`` of the minibatch of ``ws`` (the log-std's gradient is written too)"""
        d_out = self.net.d_out_buffer(ws.n)
        self.head.backward(ws.head, ws.g_log_prob, -ent_coef / ws.n, d_out, self.net.grad_log_std)
        return d_out

    def critic_loss(
        self, ws: HandDerivedWorkspace, values: th.Tensor, old_values: th.Tensor, returns: th.Tensor, cfg: PPOLossConfig
    ) -> None:
        """The critic's half: squared value errors into the value loss's stats row, ``d loss / d V`` into ``ws``."""
        err, scalars = ws.err, self._scalars
        if cfg.clip_range_vf is None:
            th.sub(values, returns, out=err)
        else:
            dv, dv_clipped = ws.dv, ws.dv_clipped
            th.sub(values, old_values, out=dv)
            if scalars is None:
                th.clamp(dv, -cfg.clip_range_vf, cfg.clip_range_vf, out=dv_clipped)
            else:
                th.clamp(dv, scalars[2], scalars[3], out=dv_clipped)
            th.eq(dv, dv_clipped, out=ws.vmask)  # the clamp passes gradient only inside the range
            th.add(old_values, dv_clipped, out=err).sub_(returns)
        th.mul(err, err, out=ws.stat_rows[VALUE_LOSS])
        th.mul(err, 2.0 * cfg.vf_coef / ws.n, out=ws.g_values_flat)
        if cfg.clip_range_vf is not None:
            ws.g_values_flat.mul_(ws.vmask)

    def backward(self) -> None:
        """Write the gradient of the last :meth:`forward`'s loss into the flat gradient buffer."""
        ws = self._pending
        assert ws is not None
        self.net.backward(self.actor_output_gradient(ws, self._pending_ent_coef), ws.g_values)

    def optimizer_step(self, max_grad_norm: float) -> None:
        """Clip the gradient's norm and take one Adam step (the clipping happens inside the fused kernel)."""
        self.adam.step(self.flat.clip_divisor(max_grad_norm), lr=None if self._scalars is None else self._scalars[4])

    def predict_values(self, observations: Any) -> th.Tensor:
        """:return: values ``[n]`` with the current parameters (for recomputing advantages)"""
        return self.net.predict_values(self.training_observations(observations))


class AutogradPPOUpdate(TrainHooks):
    """
    PPO update through autograd for any ``ActorCriticPolicy``, as SB3 computes it, minus its per-minibatch
    overheads: no distribution objects for standard heads, no host syncs, and (for a plain ``torch.optim.Adam``)
    one flat gradient buffer, one norm and one fused Adam step (:class:`FlatOptimizerStep`).

    :param policy: the policy
    :param compile_loss: run the loss through ``torch.compile`` (pays only for long runs; off by default)
    """

    def __init__(self, policy: ActorCriticPolicy, compile_loss: bool = False) -> None:
        self.policy = policy
        self.head = standard_head(policy)
        self.step = FlatOptimizerStep(policy, policy.optimizer)
        self.flat, self.adam = self.step.flat, self.step.adam
        self._discrete = isinstance(policy.action_space, spaces.Discrete)
        self._channels_last = trains_channels_last(policy, policy.device)
        loss_fn: Callable[..., tuple[th.Tensor, th.Tensor]] = self._loss
        self._loss_fn = th.compile(loss_fn) if compile_loss else loss_fn
        self._pending: th.Tensor | None = None

    def is_bound(self) -> bool:
        """:return: whether the policy's parameters, gradients and optimizer state are still ours"""
        return self.step.is_bound(self.policy.optimizer)

    def training_actions(self, actions: th.Tensor) -> dict[str, th.Tensor]:
        return {"actions": actions}

    def training_observations(self, observations: Any) -> Any:
        return observations

    def _evaluate(self, obs: Any, actions: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor | None]:
        policy = self.policy
        if self._channels_last:
            obs = to_channels_last(obs)
        if self.head is None:
            values, log_prob, entropy = policy.evaluate_actions(obs, actions.long().flatten() if self._discrete else actions)
            return values.flatten(), log_prob, entropy
        latent_pi, latent_vf = policy_latents(policy, obs)
        log_prob, entropy = self.head.log_prob_entropy(policy.action_net(latent_pi), actions, getattr(policy, "log_std", None))
        return policy.value_net(latent_vf).flatten(), log_prob, entropy

    def _loss(self, mb: Minibatch, cfg: PPOLossConfig) -> tuple[th.Tensor, th.Tensor]:
        values, log_prob, entropy = self._evaluate(mb.observations, mb.actions["actions"])
        return ppo_loss(log_prob, entropy, values, mb.old_log_prob, mb.advantages, mb.old_values, mb.returns, cfg)

    def forward(self, mb: Minibatch, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """Compute the loss (kept for :meth:`backward`) and write its statistics into ``stats``."""
        self._pending, row = self._loss_fn(mb, cfg)
        stats.copy_(row)

    def backward(self) -> None:
        """Back-propagate the last :meth:`forward`'s loss into the gradients."""
        assert self._pending is not None
        self.step.backward(self._pending)
        self._pending = None

    def optimizer_step(self, max_grad_norm: float) -> None:
        """Clip the gradient's norm and take one optimizer step."""
        self.step.step(max_grad_norm)

    @th.no_grad()
    def predict_values(self, observations: Any, chunk: int = 4096) -> th.Tensor:
        """:return: values ``[n]`` with the current parameters, ``chunk`` observations at a time"""
        first = next(iter(observations.values())) if isinstance(observations, dict) else observations
        parts = []
        for start in range(0, first.shape[0], chunk):
            if isinstance(observations, dict):
                part = {k: v[start : start + chunk] for k, v in observations.items()}
            else:
                part = observations[start : start + chunk]
            parts.append(self.policy.predict_values(part).flatten())
        return th.cat(parts)
