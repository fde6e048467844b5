"""
One PPO minibatch update, two ways with one interface (``forward`` -> ``backward`` -> ``optimizer_step``):

- :class:`ManualPPOUpdate`: the standard MLP case with the loss's gradient derived by hand (no autograd graph),
  every intermediate in a preallocated buffer, gradients straight into one flat buffer, one fused Adam step.
- :class:`AutogradPPOUpdate`: any ``ActorCriticPolicy`` through autograd, with the same flat fused Adam when the
  optimizer allows it, and the distribution maths of :mod:`sb3_speedups.common.nn.heads` where the policy is standard.

Both compute exactly SB3's loss: clipped surrogate, optionally clipped value loss, entropy bonus. ``forward`` writes
the minibatch's statistics (:data:`STATS`, means over the minibatch) into a row of a tensor without a host sync.
The loss, its gradients and the tests that check them: see docs/maths.md, "PPO loss".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.nn.training import ActorCriticMlp
from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.common.acting.actors import lean_head, policy_latents
from sb3_speedups.ppo.minibatches import Minibatch
from sb3_speedups.common.nn.optim import FlatAdam, FlatParameters, adam_unsupported_reason

#: per-minibatch statistics, in the order of a stats row: ``policy_gradient_loss`` is stored negated (``mean(min)``),
#: and SB3's ``approx_kl = mean(ratio - 1 - log_ratio)`` as ``mean(ratio)`` and ``mean(log_ratio)`` (see :func:`approx_kl`)
STATS = ("neg_policy_gradient_loss", "clip_fraction", "ratio", "log_ratio", "value_loss", "entropy_loss")
NEG_PG, CLIP_FRACTION, RATIO, LOG_RATIO, VALUE_LOSS, ENTROPY_LOSS = range(len(STATS))


def approx_kl(stats: Any) -> Any:
    """:return: SB3's approximate KL divergence from stats rows (numpy array or tensor, last dimension :data:`STATS`)"""
    return stats[..., RATIO] - 1.0 - stats[..., LOG_RATIO]


@dataclass
class PPOLossConfig:
    """The loss's coefficients for one ``train()`` call (schedules already evaluated)."""

    clip_range: float
    clip_range_vf: float | None
    ent_coef: float
    vf_coef: float
    max_grad_norm: float


class ManualPPOUpdate:
    """
    Hand-derived PPO update of an MLP ``ActorCriticPolicy``; building it moves the policy's parameters into one
    flat buffer (:class:`~sb3_speedups.common.nn.optim.FlatParameters`) and its Adam state into :class:`FlatAdam`.

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
        self._ws: dict[int, dict[str, Any]] = {}
        self._device_scalars: th.Tensor | None = None
        self._scalars: th.Tensor | None = None  # the device scalars while they are in use

    def set_device_scalars(self, cfg: PPOLossConfig, lr: float) -> None:
        """
        Read the clip ranges and the learning rate from a tensor on the training device from now on, and set them.

        A recorded CUDA graph keeps the numbers it was recorded with; read from a tensor, values that schedules
        change from one ``train()`` to the next reach every replay. (On the CPU, Adam then reads the learning rate as
        float32 instead of double: a last-bit difference in the step; on CUDA the replays were measured bit-identical
        to the op-by-op run.)

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
        """:return: the observations as the network's float input ``[N, obs_dim]``"""
        return observations.reshape(observations.shape[0], -1).float()

    @th.inference_mode(False)
    def _workspace(self, n: int, device: th.device) -> dict[str, Any]:
        # Normal tensors even when allocated under inference mode (train() runs there), so they work in any mode.
        if n not in self._ws:
            ws: dict[str, Any] = {"rows": th.empty(len(STATS), n, device=device)}
            for name in ("log_prob", "clipped", "s1", "s2", "err", "dv", "dv_clipped", "g_log_prob", "mask"):
                ws[name] = th.empty(n, device=device)
            ws["zeros"] = th.zeros(n, device=device)
            ws["mean_weights"] = th.full((n,), 1.0 / n, device=device)
            ws["g_values"] = th.empty(n, 1, device=device)
            ws["g_values_flat"] = ws["g_values"].view(-1)
            ws["row"] = list(ws["rows"])  # views of each statistic's row, made once
            ws["vmask"] = th.empty(n, dtype=th.bool, device=device)
            ws["head"] = self.head.workspace(n, device)
            self._ws[n] = ws
        return self._ws[n]

    def forward(self, mb: Minibatch, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """Write the loss's statistics into ``stats`` (a row of :data:`STATS`); keep its per-sample gradients."""
        obs = mb.observations
        assert isinstance(obs, th.Tensor)
        n = obs.shape[0]
        ws = self._ws.get(n) or self._workspace(n, obs.device)
        out, values = self.net.forward(obs)
        self._policy_loss(ws, mb, cfg, out)
        self._value_loss(ws, mb, cfg, values)
        # The means as one matrix-vector product: th.mean(rows, 1) is a sum and a division, 13.5 us here against ~2.
        th.mv(ws["rows"], ws["mean_weights"], out=stats)
        self._policy_loss_gradient(ws, n)
        self._value_loss_gradient(ws, n, cfg)
        self._pending = (ws, n, cfg.ent_coef)

    def _policy_loss(self, ws: dict[str, Any], mb: Minibatch, cfg: PPOLossConfig, out: th.Tensor) -> None:
        """The clipped surrogate and entropy into the stats rows (all but the value loss's)."""
        row = ws["row"]
        self.head.forward(ws["head"], out, mb.actions, self.net.log_std, ws["log_prob"], row[ENTROPY_LOSS])
        logratio, ratio, clipped, s1, s2 = row[LOG_RATIO], row[RATIO], ws["clipped"], ws["s1"], ws["s2"]
        th.sub(ws["log_prob"], mb.old_log_prob, out=logratio)
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

    def _value_loss(self, ws: dict[str, Any], mb: Minibatch, cfg: PPOLossConfig, values: th.Tensor) -> None:
        """The (optionally clipped) squared value errors into the value loss's stats row."""
        err, scalars = ws["err"], self._scalars
        if cfg.clip_range_vf is None:
            th.sub(values, mb.returns, out=err)
        else:
            dv, dv_clipped = ws["dv"], ws["dv_clipped"]
            th.sub(values, mb.old_values, out=dv)
            if scalars is None:
                th.clamp(dv, -cfg.clip_range_vf, cfg.clip_range_vf, out=dv_clipped)
            else:
                th.clamp(dv, scalars[2], scalars[3], out=dv_clipped)
            th.eq(dv, dv_clipped, out=ws["vmask"])  # the clamp passes gradient only inside the range
            th.add(mb.old_values, dv_clipped, out=err).sub_(mb.returns)
        th.mul(err, err, out=ws["row"][VALUE_LOSS])

    @staticmethod
    def _policy_loss_gradient(ws: dict[str, Any], n: int) -> None:
        # d loss / d log_prob: -A * ratio / n where min() picks the unclipped term, else 0.
        th.le(ws["s1"], ws["s2"], out=ws["mask"])
        th.addcmul(ws["zeros"], ws["s1"], ws["mask"], value=-1.0 / n, out=ws["g_log_prob"])

    @staticmethod
    def _value_loss_gradient(ws: dict[str, Any], n: int, cfg: PPOLossConfig) -> None:
        g_values = ws["g_values_flat"]
        th.mul(ws["err"], 2.0 * cfg.vf_coef / n, out=g_values)
        if cfg.clip_range_vf is not None:
            g_values.mul_(ws["vmask"])

    def backward(self) -> None:
        """Write the gradient of the last :meth:`forward`'s loss into the flat gradient buffer."""
        ws, n, ent_coef = self._pending
        d_out = self.net.d_out_buffer(n)
        # loss = pg - ent_coef * mean(entropy) + ...  ->  d loss / d entropy_i = -ent_coef / n
        self.head.backward(ws["head"], ws["g_log_prob"], -ent_coef / n, d_out, self.net.grad_log_std)
        self.net.backward(d_out, ws["g_values"])

    def optimizer_step(self, max_grad_norm: float) -> None:
        """Clip the gradient's norm and take one Adam step (the clipping happens inside the fused kernel)."""
        self.adam.step(self.flat.clip_divisor(max_grad_norm), lr=None if self._scalars is None else self._scalars[4])

    def predict_values(self, observations: Any) -> th.Tensor:
        """:return: values ``[n]`` with the current parameters (for recomputing advantages)"""
        return self.net.predict_values(self.training_observations(observations))


class AutogradPPOUpdate:
    """
    PPO update through autograd for any ``ActorCriticPolicy``, as SB3 computes it, minus its per-minibatch
    overheads: no distribution objects for standard heads, no host syncs, and (for a plain ``torch.optim.Adam``)
    one flat gradient buffer, one norm and one fused Adam step.

    :param policy: the policy
    :param compile_loss: run the loss through ``torch.compile`` (pays only for long runs; off by default)
    """

    def __init__(self, policy: ActorCriticPolicy, compile_loss: bool = False) -> None:
        self.policy = policy
        self.head = lean_head(policy)
        params = list(policy.parameters())
        self.flat: FlatParameters | None = None
        self.adam: FlatAdam | None = None
        if adam_unsupported_reason(policy.optimizer, params) is None:
            self.flat = FlatParameters(params)
            self.adam = FlatAdam(self.flat, policy.optimizer)
            self._attach_grads()
        self._optimizer = policy.optimizer
        self._discrete = isinstance(policy.action_space, spaces.Discrete)
        loss_fn: Callable[..., tuple[th.Tensor, th.Tensor]] = self._loss
        self._loss_fn = th.compile(loss_fn) if compile_loss else loss_fn

    def is_bound(self) -> bool:
        """:return: whether the policy's parameters, gradients and optimizer state are still ours"""
        if self.policy.optimizer is not self._optimizer:
            return False
        return self.flat is None or (self.flat.is_bound() and self.adam is not None and self.adam.is_bound())

    def training_actions(self, actions: th.Tensor) -> dict[str, th.Tensor]:
        return {"actions": actions}

    def training_observations(self, observations: Any) -> Any:
        return observations

    def _evaluate(self, obs: Any, actions: th.Tensor) -> tuple[th.Tensor, th.Tensor, th.Tensor | None]:
        policy = self.policy
        if self.head is None:
            values, log_prob, entropy = policy.evaluate_actions(obs, actions.long().flatten() if self._discrete else actions)
            return values.flatten(), log_prob, entropy
        latent_pi, latent_vf = policy_latents(policy, obs)
        log_prob, entropy = self.head.log_prob_entropy(policy.action_net(latent_pi), actions, getattr(policy, "log_std", None))
        return policy.value_net(latent_vf).flatten(), log_prob, entropy

    def _loss(self, mb: Minibatch, cfg: PPOLossConfig) -> tuple[th.Tensor, th.Tensor]:
        values, log_prob, entropy = self._evaluate(mb.observations, mb.actions["actions"])
        logratio = log_prob - mb.old_log_prob
        ratio = th.exp(logratio)
        s1 = mb.advantages * ratio
        s2 = mb.advantages * th.clamp(ratio, 1 - cfg.clip_range, 1 + cfg.clip_range)
        neg_pg = th.min(s1, s2).mean()
        if cfg.clip_range_vf is None:
            values_pred = values
        else:
            values_pred = mb.old_values + th.clamp(values - mb.old_values, -cfg.clip_range_vf, cfg.clip_range_vf)
        value_loss = F.mse_loss(mb.returns, values_pred)
        entropy_loss = -th.mean(-log_prob) if entropy is None else -th.mean(entropy)
        loss = -neg_pg + cfg.ent_coef * entropy_loss + cfg.vf_coef * value_loss
        with th.no_grad():
            clip_fraction = th.mean((th.abs(ratio - 1) > cfg.clip_range).float())
            stats = th.stack([neg_pg, clip_fraction, ratio.mean(), logratio.mean(), value_loss, entropy_loss]).detach()
        return loss, stats

    def forward(self, mb: Minibatch, cfg: PPOLossConfig, stats: th.Tensor) -> None:
        """Compute the loss (kept for :meth:`backward`) and write its statistics into ``stats``."""
        self._pending, row = self._loss_fn(mb, cfg)
        stats.copy_(row)

    def backward(self) -> None:
        """Back-propagate the last :meth:`forward`'s loss into the gradients."""
        if self.flat is None:
            self.policy.optimizer.zero_grad()
        else:
            self.flat.grad.zero_()
        self._pending.backward()
        del self._pending
        if self.flat is not None and any(p.grad is not g for p, g in zip(self.flat.params, self._grad_views, strict=True)):
            # Someone set the gradients to None (``optimizer.zero_grad()``): take autograd's and re-attach.
            for p in self.flat.params:
                if p.grad is not None:
                    self.flat.grad_of(p).copy_(p.grad)
            self._attach_grads()

    def _attach_grads(self) -> None:
        assert self.flat is not None
        self.flat.attach_grads()
        self._grad_views = [p.grad for p in self.flat.params]

    def optimizer_step(self, max_grad_norm: float) -> None:
        """Clip the gradient's norm and take one optimizer step."""
        if self.flat is None or self.adam is None:
            th.nn.utils.clip_grad_norm_(self.policy.parameters(), max_grad_norm)
            self.policy.optimizer.step()
            return
        self.adam.step(self.flat.clip_divisor(max_grad_norm))

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
