"""
sb3-contrib's ``quantile_huber_loss`` and its gradient with respect to the current quantiles, by hand: what QR-DQN's
and TQC's hand-derived critic steps share. The maths: docs/maths.md, "QR-DQN quantile Huber loss".

With ``δ = y_t - θ_j`` for every current quantile ``θ_j`` (level ``τ_j = (j + 0.5) / Q``) and target ``y_t``,
``c = clamp(δ, -1, 1)`` and ``c⁻ = clamp(δ, -1, 0)``, the weight ``|τ_j - [δ < 0]|`` is ``τ_j + (1 - 2τ_j) [δ < 0]``,
so with ``N`` the loss's divisor:

- ``N ∂L/∂θ_j = -(τ_j Σ_t c + (1 - 2τ_j) Σ_t c⁻)``
- ``N L = Σ_j τ_j Σ_t c (δ - c/2) + (1 - 2τ_j) Σ_t c⁻ (δ - c⁻/2)`` (the Huber loss ``c (δ - c/2)``)

The four sums over the targets are one product of the four terms, side by side, with a column of ones; the loss is
then one dot product of the last two sums with the kept weights ``τ_j / N`` and ``(1 - 2τ_j) / N``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch as th


@dataclass
class _Pairwise:
    """Kept buffers and views of one call shape (pairs ``[..., Q, T]``), made once: a call then runs only kernels."""

    #: ``δ = y_t - θ_j``
    delta: th.Tensor
    #: ``c``, ``c⁻``, ``c (δ - c/2)`` and ``c⁻ (δ - c⁻/2)``, side by side ``[4, ..., Q, T]``
    terms: th.Tensor
    #: the four terms' views ``[..., Q, T]``
    slope: th.Tensor
    negative: th.Tensor
    huber: th.Tensor
    negative_huber: th.Tensor
    #: ``terms`` as ``[4 ... Q, T]`` rows (the product's left side)
    rows: th.Tensor
    #: ``[T, 1]`` ones
    ones: th.Tensor
    #: the four sums over the targets ``[4 ... Q, 1]`` (the product's output)
    sums: th.Tensor
    #: their views ``[..., Q]`` of ``c`` and ``c⁻`` (the gradient's)
    sum_slope: th.Tensor
    sum_negative: th.Tensor
    #: ``τ`` and ``1 - 2τ`` ``[Q]``
    tau: th.Tensor
    skew: th.Tensor
    #: ``1 / N``
    scale: float
    #: the two Huber sums as one vector ``[2 ... Q]`` and their weights in the loss (``τ / N``, then ``(1 - 2τ) / N``)
    huber_sums: th.Tensor
    loss_weights: th.Tensor


class QuantileHuberLoss:
    """
    The quantile Huber loss of ``Q`` current quantiles against ``T`` targets per row, and its gradient.

    :param n_quantiles: ``Q``, the current quantiles of a row (their levels are sb3-contrib's midpoints)
    """

    def __init__(self, n_quantiles: int) -> None:
        self.n_quantiles = n_quantiles
        # by the call's shapes, device and reduction: the hot loop's calls look up their buffers and views in one step
        self._pairwise: dict[tuple[th.Size, th.Size, th.device, bool], _Pairwise] = {}

    def _levels(self, device: th.device) -> tuple[th.Tensor, th.Tensor]:
        """:return: ``τ`` (as sb3-contrib computes it) and ``1 - 2τ``, each ``[Q]``"""
        tau = (th.arange(self.n_quantiles, device=device, dtype=th.float) + 0.5) / self.n_quantiles
        return tau, 1 - 2 * tau

    @th.inference_mode(False)  # normal tensors, usable in any mode
    def _buffers(self, target: th.Tensor, current: th.Tensor, sum_over_quantiles: bool) -> _Pairwise:
        shape = th.broadcast_shapes((*target.shape[:-1], 1, target.shape[-1]), (*current.shape, 1))
        device = current.device
        terms = th.empty(4, *shape, device=device)
        rows = terms.view(-1, shape[-1])
        sums = th.empty(rows.shape[0], 1, device=device)
        delta = th.empty(shape, device=device)
        pairs = delta.numel()
        scale = 1.0 / (pairs // self.n_quantiles if sum_over_quantiles else pairs)
        tau, skew = self._levels(device)
        slope, negative, huber, negative_huber = terms.unbind(0)
        sum_slope, sum_negative = sums.view(4, *shape[:-1]).unbind(0)[:2]
        # the loss's weights, one per Huber sum (the loss is only logged: its rounding need not be the step's)
        per_row = th.stack([tau.expand(shape[:-1]), skew.expand(shape[:-1])]).reshape(-1)
        pairwise = _Pairwise(
            delta,
            terms,
            slope,
            negative,
            huber,
            negative_huber,
            rows,
            th.ones(shape[-1], 1, device=device),
            sums,
            sum_slope,
            sum_negative,
            tau,
            skew,
            scale,
            sums.view(-1)[per_row.shape[0] :],
            per_row * scale,
        )
        self._pairwise[(target.shape, current.shape, device, sum_over_quantiles)] = pairwise
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
        buf = self._pairwise.get((target.shape, current.shape, current.device, sum_over_quantiles))
        if buf is None:
            buf = self._buffers(target, current, sum_over_quantiles)
        delta, slope, negative = buf.delta, buf.slope, buf.negative
        th.sub(target.unsqueeze(-2), current.unsqueeze(-1), out=delta)
        th.clamp(delta, -1.0, 1.0, out=slope)
        th.clamp(slope, max=0.0, out=negative)
        th.add(delta, slope, alpha=-0.5, out=buf.huber).mul_(slope)
        th.add(delta, negative, alpha=-0.5, out=buf.negative_huber).mul_(negative)
        th.mm(buf.rows, buf.ones, out=buf.sums)
        loss = th.dot(buf.huber_sums, buf.loss_weights)
        grad = th.mul(buf.sum_slope, buf.tau, out=out).addcmul_(buf.sum_negative, buf.skew).mul_(-buf.scale)
        return grad, loss
