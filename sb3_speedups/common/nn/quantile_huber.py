"""
sb3-contrib's ``quantile_huber_loss`` and its gradient with respect to the current quantiles, by hand: what QR-DQN's
and TQC's hand-derived critic steps share. The maths: docs/maths.md, "QR-DQN quantile Huber loss".

With ``δ = y_t - θ_j`` for every current quantile ``θ_j`` (level ``τ_j = (j + 0.5) / Q``) and target ``y_t``,
``c = clamp(δ, -1, 1)`` and ``c⁻ = clamp(δ, -1, 0)``, the weight ``|τ_j - [δ < 0]|`` is ``τ_j + (1 - 2τ_j) [δ < 0]``,
so with ``N`` the loss's divisor:

- ``N ∂L/∂θ_j = -(τ_j Σ_t c + (1 - 2τ_j) Σ_t c⁻)``
- ``N L = Σ_j τ_j Σ_t c (δ - c/2) + (1 - 2τ_j) Σ_t c⁻ (δ - c⁻/2)`` (the Huber loss ``c (δ - c/2)``)

The four sums over the targets are one product of the four terms, side by side, with a column of ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch as th


@dataclass
class _Pairwise:
    """Kept buffers of one shape of pairs ``[..., Q, T]``."""

    #: ``δ = y_t - θ_j``
    delta: th.Tensor
    #: ``c``, ``c⁻``, ``c (δ - c/2)`` and ``c⁻ (δ - c⁻/2)``, side by side ``[4, ..., Q, T]``
    terms: th.Tensor
    #: ``[T, 1]`` ones
    ones: th.Tensor
    #: the four sums over the targets ``[4 ... Q, 1]``
    sums: th.Tensor


class QuantileHuberLoss:
    """
    The quantile Huber loss of ``Q`` current quantiles against ``T`` targets per row, and its gradient.

    :param n_quantiles: ``Q``, the current quantiles of a row (their levels are sb3-contrib's midpoints)
    """

    def __init__(self, n_quantiles: int) -> None:
        self.n_quantiles = n_quantiles
        self._pairwise: dict[tuple[tuple[int, ...], th.device], _Pairwise] = {}
        self._levels: dict[th.device, th.Tensor] = {}

    def _levels_on(self, device: th.device) -> th.Tensor:
        """:return: ``τ`` and ``1 - 2τ`` ``[2, Q]``, ``τ`` as sb3-contrib computes it"""
        levels = self._levels.get(device)
        if levels is None:
            with th.inference_mode(False):  # normal tensors, usable in any mode
                tau = (th.arange(self.n_quantiles, device=device, dtype=th.float) + 0.5) / self.n_quantiles
                levels = self._levels[device] = th.stack([tau, 1 - 2 * tau])
        return levels

    def _buffers(self, shape: tuple[int, ...], device: th.device) -> _Pairwise:
        pairwise = self._pairwise.get((shape, device))
        if pairwise is None:
            with th.inference_mode(False):
                terms = th.empty(4, *shape, device=device)
                sums = th.empty(terms.numel() // shape[-1], 1, device=device)
                pairwise = _Pairwise(th.empty(shape, device=device), terms, th.ones(shape[-1], 1, device=device), sums)
                self._pairwise[(shape, device)] = pairwise
        return pairwise

    def __call__(
        self, current: th.Tensor, target: th.Tensor, sum_over_quantiles: bool, out: th.Tensor | None = None
    ) -> tuple[th.Tensor, th.Tensor]:
        """
        :param current: the current quantiles ``[..., Q]``
        :param target: the targets ``[..., T]``, their leading dimensions broadcast against ``current``'s
        :param sum_over_quantiles: sb3-contrib's argument: the loss sums over the current quantiles and averages over
            the rest (QR-DQN), else it averages over everything (TQC)
        :param out: where to write the gradient (may be ``current``: its values are read before)
        :return: ``∂L/∂current`` (shaped as ``current``) and the loss (0-dim)
        """
        levels = self._levels_on(current.device)
        tau, skew = levels[0], levels[1]
        shape = th.broadcast_shapes((*target.shape[:-1], 1, target.shape[-1]), (*current.shape, 1))
        buf = self._buffers(tuple(shape), current.device)
        delta = th.sub(target.unsqueeze(-2), current.unsqueeze(-1), out=buf.delta)
        slope, negative, huber, negative_huber = buf.terms.unbind(0)
        th.clamp(delta, -1.0, 1.0, out=slope)
        th.clamp(slope, max=0.0, out=negative)
        th.add(delta, slope, alpha=-0.5, out=huber).mul_(slope)
        th.add(delta, negative, alpha=-0.5, out=negative_huber).mul_(negative)
        sums = th.mm(buf.terms.view(-1, delta.shape[-1]), buf.ones, out=buf.sums).view(4, *delta.shape[:-1])
        scale = 1.0 / (delta.numel() // self.n_quantiles if sum_over_quantiles else delta.numel())
        loss = th.sum(sums[2] * tau + sums[3] * skew) * scale
        grad = th.mul(sums[0], tau, out=out).addcmul_(sums[1], skew).mul_(-scale)
        return grad, loss
