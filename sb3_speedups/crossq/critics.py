"""
CrossQ's critics (sb3-contrib's ``CrossQCritic``: ``n_critics`` networks of ``Linear`` layers, each preceded by a
``BatchRenorm1d`` layer, on ``[obs, action]``) with hand-derived gradients: the critics' step of ``CrossQ.train``, the
joint training-mode forward of ``(s, a)`` and ``(s', a')`` and its backward, as one batched product per layer of the
stacked networks (:class:`~sb3_speedups.common.nn.training.MlpChain`) with the batch-renormalisation layers as its
input norms (:class:`~sb3_speedups.crossq.stacked_renorm.StackedRenorm`). CrossQ has no target networks. The maths:
docs/maths.md, "CrossQ batch renormalisation" and "Off-policy critics".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch as th
from sb3_contrib.common.torch_layers import BatchRenorm1d
from sb3_contrib.crossq.policies import Actor, CrossQCritic
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from torch import nn

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.mlp import Mlp, parse_mlp
from sb3_speedups.common.nn.optim import FlatAdam, adam_unsupported_reason
from sb3_speedups.common.nn.training import InputNorm, MlpChain
from sb3_speedups.common.off_policy.actor_net import ActorNet
from sb3_speedups.common.off_policy.critics import StackedCritics, q_networks, stacked_head
from sb3_speedups.crossq.batch_renorm import RenormCounts
from sb3_speedups.crossq.stacked_renorm import StackedRenorm


def parse_renorm_mlp(net: nn.Module) -> tuple[Mlp, list[BatchRenorm1d | None]] | str:
    """
    :param net: an ``nn.Sequential`` of ``Linear`` layers, each followed by at most one activation, with at most one
        ``BatchRenorm1d`` layer before each ``Linear`` layer and one at the end
    :return: its MLP without the ``BatchRenorm1d`` layers, and the layer before each ``Linear`` layer and at the
        end (``None`` where there is none), or why it is not such a network
    """
    if not isinstance(net, nn.Sequential):
        return f"{type(net).__name__} is not an nn.Sequential"
    norms: list[BatchRenorm1d | None] = [None]
    plain: list[nn.Module] = []
    for layer in net:
        if isinstance(layer, BatchRenorm1d):
            if norms[-1] is not None:
                return "two BatchRenorm1d layers in a row"
            norms[-1] = layer
        elif type(layer) is nn.Linear:
            plain.append(layer)
            norms.append(None)
        elif norms[-1] is not None:
            return f"a {type(layer).__name__} layer after a BatchRenorm1d layer"
        else:
            plain.append(layer)
    mlp = parse_mlp(nn.Sequential(*plain))
    return mlp if isinstance(mlp, str) else (mlp, norms)


def renorm_critics_reason(critic: nn.Module, optimizer: th.optim.Optimizer) -> str | None:
    """:return: why :class:`RenormCritics` cannot run ``critic`` (a ``CrossQCritic`` on flat features), or ``None``"""
    parsed = [parse_renorm_mlp(q) for q in q_networks(critic)]  # type: ignore[arg-type]
    for found in parsed:
        if isinstance(found, str):
            return f"critic: {found}"
        hidden, last = found[0].head()
        if last is None or not hidden.layers or last.activation.name != "none" or last.bias is None:
            return "critic: not hidden layers and a Linear output layer"
        if found[1][-1] is not None:
            return "critic: a BatchRenorm1d layer after its output layer"
        reason = hidden.trainable_reason()
        if reason is not None:
            return f"critic: {reason}"
        if [type(m) for m in found[1]] != [type(m) for m in parsed[0][1]]:  # type: ignore[index]
            return "critics with BatchRenorm1d layers in different places"
    shapes = {tuple(lay.weight.shape for lay in found[0].layers) for found in parsed}  # type: ignore[union-attr]
    if len(shapes) != 1:
        return "critics of different shapes"
    if any(p.dtype != th.float32 for p in critic.parameters()):
        return "critic parameters are not float32"
    return adam_unsupported_reason(optimizer, list(critic.parameters()))


def use_norms(norms: Sequence[InputNorm | None], training: bool) -> None:
    """Run the :class:`StackedRenorm` layers among ``norms`` in training (batch statistics) or evaluation mode."""
    for norm in norms:
        if isinstance(norm, StackedRenorm):
            norm.training = training


def count_norms(norms: Sequence[InputNorm | None], counts: RenormCounts) -> None:
    """Give the :class:`StackedRenorm` layers among ``norms`` this ``train()`` call's step counts (the warm-up test)."""
    for norm in norms:
        if isinstance(norm, StackedRenorm):
            norm.counts = counts


def renorm_actor_reason(actor: Actor) -> str | None:
    """:return: why :func:`renorm_actor_net` cannot take CrossQ's ``actor`` (checked as for the update), or ``None``"""
    found = parse_renorm_mlp(actor.latent_pi)
    if isinstance(found, str):
        return f"actor: {found}"
    if not found[0].layers:
        return "actor has no hidden layer"
    reason = found[0].trainable_reason()
    if reason is not None:
        return f"actor: {reason}"
    if type(actor.mu) is not nn.Linear or type(actor.log_std) is not nn.Linear:
        return "actor heads are not Linear layers"
    if any(p.dtype != th.float32 for p in actor.parameters()):
        return "actor parameters are not float32"
    return adam_unsupported_reason(actor.optimizer, list(actor.parameters()))


def renorm_actor_net(actor: Actor) -> ActorNet:
    """
    :return: CrossQ's actor (check :func:`renorm_actor_reason` first) with hand-derived gradients, its
        batch-renormalisation layers as the hidden chain's input norms in training mode
    """
    hidden, norms = cast(tuple[Mlp, list[BatchRenorm1d | None]], parse_renorm_mlp(actor.latent_pi))
    mu, log_std = cast(nn.Linear, actor.mu), cast(nn.Linear, actor.log_std)

    def stacked_norms(flat: FlatParameters) -> list[StackedRenorm | None]:
        return [None if m is None else StackedRenorm([m], flat) for m in norms]

    return ActorNet(actor, hidden, [mu.weight, log_std.weight], [mu.bias, log_std.bias], actor.optimizer, stacked_norms)


class RenormCritics(StackedCritics):
    """
    The critics of CrossQ, stacked (check :func:`renorm_critics_reason` first); building it moves their parameters
    into one flat buffer and their batch-renormalisation statistics into stacked buffers. :meth:`q_values` runs the
    layers in the mode :meth:`use` sets. CrossQ has no target critics: the target methods of :class:`StackedCritics`
    do not apply.

    :param critic: the critics
    :param optimizer: their Adam (runs fused over the flat buffer)
    """

    def __init__(self, critic: CrossQCritic, optimizer: th.optim.Optimizer) -> None:
        reason = renorm_critics_reason(critic, optimizer)
        if reason is not None:
            raise ValueError(reason)
        self.critic = critic
        self.obs_dim = int(cast(BaseFeaturesExtractor, critic.features_extractor).features_dim)
        parsed = cast(list[tuple[Mlp, list[BatchRenorm1d | None]]], [parse_renorm_mlp(q) for q in q_networks(critic)])
        mlps = [mlp for mlp, _ in parsed]
        self.groups = len(mlps)
        self.width = int(mlps[0].layers[-1].weight.shape[0])
        layout: list[th.Tensor] = []
        for k, layers in enumerate(zip(*(mlp.layers for mlp in mlps), strict=True)):
            norms = [found[1][k] for found in parsed]
            if norms[0] is not None and norms[0].affine:
                layout += [m.scale for m in norms if m is not None] + [m.bias for m in norms if m is not None]
            layout += [lay.weight for lay in layers] + [cast(th.Tensor, lay.bias) for lay in layers]
        self.flat = FlatParameters(list(critic.parameters()), layout)
        self.adam = FlatAdam(self.flat, optimizer)
        # the norm before the output layer normalises the hidden chain's output
        self.norms = [
            None if norms[0] is None else StackedRenorm(cast(list[BatchRenorm1d], norms), self.flat)
            for norms in zip(*(found[1][:-1] for found in parsed), strict=True)
        ]
        self.chain = MlpChain(self.flat, [mlp.head()[0] for mlp in mlps], self.norms)
        self.head = stacked_head(self.flat, mlps, self.groups)
        self._q: dict[tuple[int, int], th.Tensor] = {}

    def is_bound(self) -> bool:
        """:return: whether the parameters, the optimizer state and the statistics still live in the kept buffers"""
        return self.flat.is_bound() and self.adam.is_bound() and all(n is None or n.is_bound() for n in self.norms)

    def begin(self, counts: RenormCounts) -> None:
        """Take this ``train()`` call's step counts (the warm-up test reads them, not the ``steps`` buffers)."""
        count_norms(self.norms, counts)

    def use(self, training: bool) -> None:
        """Run the batch-renormalisation layers in training (batch statistics) or evaluation mode from now on."""
        use_norms(self.norms, training)

    def joint_step(self, q: th.Tensor, target: th.Tensor) -> th.Tensor:
        """
        One Adam step of CrossQ's critic loss, ``0.5 * sum_g mean((Q_g(s, a) - target) ** 2)``, after the joint
        training-mode forward of ``[[s, a], [s', a']]`` (:meth:`q_values`): the batch statistics are those of both
        halves, so the gradient reaches the second half's rows through them.

        :param q: the values of that forward ``[G, 2 * b, 1]`` (overwritten)
        :param target: the TD targets ``[b, 1]``
        :return: the loss (0-dim)
        """
        b = target.shape[0]
        diff = q[:, :b].sub_(target)
        loss = th.mul(th.sum(th.square(diff)), 0.5 / b)
        diff.mul_(1.0 / b)  # dL/dQ on the first half
        q[:, b:] = 0.0  # no loss on the second half
        self.backward_step(q)
        return loss

    def backward_step(self, d_q: th.Tensor) -> None:
        """
        :meth:`StackedCritics.backward_step`; the norm before the one-unit output layers of stacked critics in training
        mode takes its column sums from that layer's gradients (:meth:`StackedRenorm.backward_linear`).
        """
        last = self.norms[-1] if self.norms else None
        centred = last.centred() if last is not None and self.width == 1 and self.groups > 1 else None
        if centred is None:
            super().backward_step(d_q)
            return
        assert last is not None
        head = self.head
        th.bmm(d_q.transpose(1, 2), centred, out=head.grad_weight)
        th.sum(d_q, 1, out=head.grad_bias)
        d_last = last.backward_linear(d_q, head.weight, head.grad_weight, head.grad_bias, None)
        self.chain.backward(d_last, output_norm=False)
        self.adam.step()
