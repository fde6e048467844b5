"""
The critics of SAC, TD3, DDPG and TQC (SB3's ``ContinuousCritic``, sb3-contrib's TQC ``Critic``: ``n_critics`` MLPs
on ``[obs, action]``, of one output or of ``n_quantiles``) with hand-derived gradients, and the flat-buffer pieces their
updates share.

The ``n_critics`` equally shaped networks lie side by side in one flat buffer and run as one batched product per
layer (:class:`~sb3_speedups.common.nn.training.MlpChain` with ``G = n_critics``); their target copy lies in a second
flat buffer of the same layout, so the polyak update is two element-wise kernels over the whole buffer. The maths:
docs/maths.md, "Off-policy critics".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import BaseModel, BasePolicy, ContinuousCritic
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor
from stable_baselines3.common.utils import get_parameters_by_name
from torch import nn

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.inputs import flat_extractor_unsupported_reason, flat_input_unsupported_reason
from sb3_speedups.common.nn.mlp import Mlp, parse_output_mlp
from sb3_speedups.common.nn.optim import FlatAdam, adam_unsupported_reason
from sb3_speedups.common.nn.training import MlpChain


def flat_input_reason(space: spaces.Space, features_extractor: nn.Module) -> str | None:
    """
    :return: why a network on ``space`` is not a plain MLP on the observations' float rows (flat ``Box``,
        ``Discrete``, ``MultiDiscrete``, ``MultiBinary``, or a ``Dict`` of those), or ``None``
    """
    return flat_input_unsupported_reason(space) or flat_extractor_unsupported_reason(features_extractor)  # type: ignore[arg-type]


def stock_actor_reason(actor: nn.Module, actor_class: type[nn.Module]) -> str | None:
    """:return: why ``actor`` is not the stock ``actor_class`` on the observations' float rows, or ``None``"""
    if type(actor) is not actor_class:
        return f"actor class {type(actor).__name__} is not the stock Actor"
    return flat_input_reason(actor.observation_space, actor.features_extractor)  # type: ignore[arg-type]


def q_networks(critic: BaseModel) -> list[nn.Module]:
    """:return: a critic's ``n_critics`` networks (``q_networks`` of SB3's ``ContinuousCritic`` and TQC's ``Critic``)"""
    return list(cast(list[nn.Module], critic.q_networks))


def critic_unsupported_reason(
    critic: BaseModel, optimizer: th.optim.Optimizer, critic_class: type[BaseModel] = ContinuousCritic
) -> str | None:
    """
    :param critic_class: the stock critic class of the algorithm (its ``q_networks`` take ``[features, actions]``)
    :return: why :class:`StackedCritics` cannot run ``critic`` (trained by ``optimizer``), or ``None``
    """
    if type(critic) is not critic_class:
        return f"critic class {type(critic).__name__} is not the stock {critic_class.__name__}"
    reason = flat_input_reason(critic.observation_space, cast(nn.Module, critic.features_extractor))
    if reason is not None:
        return reason
    mlps = [parse_output_mlp(q) for q in q_networks(critic)]
    for mlp in mlps:
        if isinstance(mlp, str):
            return f"critic: {mlp}"
        if len(mlp.layers) < 2:
            return "critic has no hidden layer"
    if any(p.dtype != th.float32 for p in critic.parameters()):
        return "critic parameters are not float32"
    return adam_unsupported_reason(optimizer, list(critic.parameters()))


def actor_and_critic_training_reason(
    actor: BasePolicy, critic: BaseModel, critic_class: type[BaseModel] = ContinuousCritic
) -> str | None:
    """
    :param actor: an actor whose network the hand-derived update already accepts (each algorithm checks its own)
    :param critic: the critic
    :param critic_class: the algorithm's stock critic class
    :return: why the two cannot train on flat float32 parameters with the fused Adam, or ``None``
    """
    if any(p.dtype != th.float32 for p in actor.parameters()):
        return "actor parameters are not float32"
    reason = adam_unsupported_reason(actor.optimizer, list(actor.parameters()))
    return reason or critic_unsupported_reason(critic, critic.optimizer, critic_class)


def stacked_layout(mlps: Sequence[Mlp]) -> list[th.Tensor]:
    """:return: the networks' tensors ordered layer by layer, each tensor of all networks side by side (stackable)"""
    return [
        t
        for layers in zip(*(m.layers for m in mlps), strict=True)
        for t in (*(lay.weight for lay in layers), *(lay.bias for lay in layers))
        if t is not None
    ]  # type: ignore[misc]


def polyak_(target: th.Tensor, source: th.Tensor, tau: float) -> None:
    """``target = (1 - tau) * target + tau * source`` with the element-wise operations of SB3's ``polyak_update``."""
    target.mul_(1 - tau).add_(source, alpha=tau)


@th.no_grad()
def foreach_polyak_(targets: Sequence[th.Tensor], sources: Sequence[th.Tensor], tau: float) -> None:
    """:func:`polyak_` of every tensor of ``targets`` (parameters anywhere), two kernel calls in all"""
    th._foreach_mul_(list(targets), 1 - tau)
    th._foreach_add_(list(targets), list(sources), alpha=tau)


@dataclass
class SoftUpdate:
    """
    Stock's target update of one network in foreach calls: ``polyak_update`` of the parameters by ``tau``, and of the
    running statistics (BatchNorm's ``running_*`` buffers, found as stock finds them) by 1, a copy whatever ``tau``.
    """

    targets: list[th.Tensor]
    sources: list[th.Tensor]
    target_statistics: list[th.Tensor]
    statistics: list[th.Tensor]

    @classmethod
    def between(cls, source: nn.Module, target: nn.Module) -> SoftUpdate:
        """:return: the update of ``target`` towards ``source`` (same architecture)"""
        return cls(
            list(target.parameters()),
            list(source.parameters()),
            get_parameters_by_name(target, ["running_"]),
            get_parameters_by_name(source, ["running_"]),
        )

    def __call__(self, tau: float) -> None:
        foreach_polyak_(self.targets, self.sources, tau)
        if self.statistics:
            foreach_polyak_(self.target_statistics, self.statistics, 1.0)


def parameters_only_in(module: nn.Module, other: nn.Module) -> list[nn.Parameter]:
    """:return: ``module``'s parameters that ``other`` does not hold (not a features extractor the two share)"""
    shared = {id(p) for p in other.parameters()}
    return [p for p in module.parameters() if id(p) not in shared]


@contextmanager
def without_weight_gradients(params: Sequence[nn.Parameter]) -> Iterator[None]:
    """
    Autograd computes no gradient for ``params`` inside the block (a loss that trains another network through their
    module needs only the gradient of its inputs; pass :func:`parameters_only_in` so that what the two share trains).
    """
    frozen = [p for p in params if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p in frozen:
            p.requires_grad_(True)


@dataclass
class _Head:
    """The output layers ``[G, out, width]`` of the stacked critics: views, their transposes and their gradients."""

    weight: th.Tensor
    weight_t: th.Tensor
    bias: th.Tensor
    grad_weight: th.Tensor
    grad_bias: th.Tensor


def stacked_head(flat: FlatParameters, mlps: Sequence[Mlp], count: int) -> _Head:
    """:return: the output layers of the first ``count`` networks, stacked, as views of ``flat``"""
    last = [m.layers[-1] for m in mlps[:count]]
    weight = flat.stacked([lay.weight for lay in last])
    bias = flat.stacked([lay.bias for lay in last if lay.bias is not None]).unsqueeze(1)
    grad_weight = flat.stacked([lay.weight for lay in last], grad=True)
    grad_bias = flat.stacked([lay.bias for lay in last if lay.bias is not None], grad=True)
    return _Head(weight, weight.transpose(1, 2), bias, grad_weight, grad_bias)


class StackedCritics:
    """
    Hand-derived forward and backward of a ``ContinuousCritic`` (or TQC's ``Critic``) and the forward of its target
    copy (check :func:`critic_unsupported_reason` first). Building it moves both networks' parameters into flat buffers.

    :param critic: the critics
    :param critic_target: their target copy (same architecture)
    :param optimizer: the critics' Adam (runs fused over the flat buffer)
    :param critic_class: the algorithm's stock critic class
    """

    def __init__(
        self,
        critic: BaseModel,
        critic_target: BaseModel,
        optimizer: th.optim.Optimizer,
        critic_class: type[BaseModel] = ContinuousCritic,
    ) -> None:
        reason = critic_unsupported_reason(critic, optimizer, critic_class)
        if reason is not None:
            raise ValueError(reason)
        self.critic, self.critic_target = critic, critic_target
        self.obs_dim = int(cast(BaseFeaturesExtractor, critic.features_extractor).features_dim)
        online = [parse_output_mlp(q) for q in q_networks(critic)]
        target = [parse_output_mlp(q) for q in q_networks(critic_target)]
        assert all(isinstance(m, Mlp) for m in (*online, *target))
        mlps: list[Mlp] = online  # type: ignore[assignment]
        target_mlps: list[Mlp] = target  # type: ignore[assignment]
        self.groups = len(mlps)
        #: outputs per critic (1, or TQC's ``n_quantiles``)
        self.width = int(mlps[0].layers[-1].weight.shape[0])
        self.flat = FlatParameters(list(critic.parameters()), stacked_layout(mlps))
        self.target_flat = FlatParameters(list(critic_target.parameters()), stacked_layout(target_mlps))
        self.adam = FlatAdam(self.flat, optimizer)
        self.chain = MlpChain(self.flat, [m.head()[0] for m in mlps])
        # the first critic alone, on the same views (TD3's and DDPG's actor loss reads only it)
        self.first_chain = MlpChain(self.flat, [mlps[0].head()[0]])
        self.target_chain = MlpChain(self.target_flat, [m.head()[0] for m in target_mlps])
        self.head = stacked_head(self.flat, mlps, self.groups)
        self.first_head = stacked_head(self.flat, mlps, 1)
        self.target_head = stacked_head(self.target_flat, target_mlps, self.groups)
        self._q: dict[tuple[int, int], th.Tensor] = {}

    def is_bound(self) -> bool:
        """:return: whether the parameters and the optimizer state still live in the flat buffers"""
        return self.flat.is_bound() and self.target_flat.is_bound() and self.adam.is_bound()

    def _out(self, head: _Head, h: th.Tensor, key: int) -> th.Tensor:
        out = self._q.get((key, h.shape[1]))
        if out is None:
            with th.inference_mode(False):
                out = self._q[(key, h.shape[1])] = th.empty(h.shape[0], h.shape[1], self.width, device=h.device)
        return th.baddbmm(head.bias, h, head.weight_t, out=out)

    def target_min(self, x: th.Tensor) -> th.Tensor:
        """:return: the smallest target critic value ``[n, 1]`` of inputs ``x = [next_obs, next_actions]``"""
        return th.amin(self.target_q_values(x), dim=0)

    def target_q_values(self, x: th.Tensor) -> th.Tensor:
        """:return: every target critic's values ``[G, n, width]`` of inputs ``x`` (a buffer the next call reuses)"""
        return self._out(self.target_head, self.target_chain.forward(x), 0)

    def q_values(self, x: th.Tensor) -> th.Tensor:
        """:return: every critic's values ``[G, n, width]`` of inputs ``[obs, actions]`` (a buffer the next call reuses)"""
        return self._out(self.head, self.chain.forward(x), 1)

    def first_q_values(self, x: th.Tensor) -> th.Tensor:
        """:return: the first critic's values ``[1, n, 1]`` (a buffer the next call reuses)"""
        return self._out(self.first_head, self.first_chain.forward(x), 2)

    def step(self, x: th.Tensor, target: th.Tensor, scale: float) -> th.Tensor:
        """
        One Adam step on ``scale * sum_g mean((Q_g(x) - target) ** 2)``.

        :param x: inputs ``[obs, actions]`` ``[n, obs_dim + action_dim]``
        :param target: TD targets ``[n, 1]``
        :param scale: 0.5 for SAC's loss, 1 for TD3's
        :return: the loss (0-dim)
        """
        n = x.shape[0]
        diff = self.q_values(x).sub_(target)
        loss = th.mul(th.sum(th.square(diff)), scale / n)
        diff.mul_(2 * scale / n)  # now dL/dQ
        self.backward_step(diff)
        return loss

    def backward_step(self, d_q: th.Tensor) -> None:
        """
        Back-propagate a loss's gradient with respect to the values of the last :meth:`q_values` and take one Adam step.

        :param d_q: that gradient ``[G, n, width]`` (it may be the values' own buffer)
        """
        n = d_q.shape[1]
        head = self.head
        th.bmm(d_q.transpose(1, 2), self.chain.output(n), out=head.grad_weight)
        th.sum(d_q, 1, out=head.grad_bias)
        self.chain.backward(self._head_backward(head, d_q, self.chain))
        self.adam.step()

    def _head_backward(self, head: _Head, d_q: th.Tensor, chain: MlpChain) -> th.Tensor:
        """:return: the gradient of the chain's output, ``d_q @ weight``, in its buffer"""
        d_last = chain.last_grad(d_q.shape[1])
        if self.width == 1:  # an outer product: one multiplication per entry, as the product's, and faster
            return th.mul(d_q, head.weight, out=d_last)
        return th.bmm(d_q, head.weight, out=d_last)

    def action_grad(self, d_q: th.Tensor, first: bool = False) -> th.Tensor:
        """
        :param d_q: the loss's gradient with respect to the values of the last :meth:`q_values` (or
            :meth:`first_q_values` with ``first``) ``[G, n, 1]``
        :return: the loss's gradient with respect to the actions of that forward ``[n, action_dim]``, through the
            critics' current weights (no weight gradients are computed)
        """
        chain, head = (self.first_chain, self.first_head) if first else (self.chain, self.head)
        d_actions = chain.backward_input(self._head_backward(head, d_q, chain), slice(self.obs_dim, None))
        return d_actions[0] if d_actions.shape[0] == 1 else d_actions.sum(0)

    def polyak(self, tau: float) -> None:
        """Move the target critics towards the critics (SB3's ``polyak_update`` over the whole flat buffer)."""
        polyak_(self.target_flat.data, self.flat.data, tau)
