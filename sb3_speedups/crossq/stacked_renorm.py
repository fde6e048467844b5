"""
``G`` equally shaped ``BatchRenorm1d`` layers as one input norm of
:class:`~sb3_speedups.common.nn.training.MlpChain` (CrossQ's hand-derived step), on the functions of
:mod:`sb3_speedups.crossq.batch_renorm` with kept buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch as th
from sb3_contrib.common.torch_layers import BatchRenorm1d

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.crossq.batch_renorm import (
    RenormBuffers,
    RenormConstants,
    RenormCounts,
    RenormSaved,
    batch_statistics,
    eval_renorm,
    renorm_backward,
    renorm_backward_from_sums,
    renorm_constants,
    renorm_output,
)


class StackedRenorm:
    """
    ``G`` equally shaped ``BatchRenorm1d`` layers (one per critic, at one place of the networks; or one layer) as one
    normalisation of a ``[G, n, F]`` block, with the state its backward needs kept: an
    :class:`~sb3_speedups.common.nn.training.InputNorm` of :class:`~sb3_speedups.common.nn.training.MlpChain`. In
    training mode (:attr:`training`) it normalises by the batch statistics and updates the running ones; in evaluation
    mode by the running ones, and its backward gives the input's gradient only (what a loss that trains another network
    through this one needs). For ``G > 1``, building it moves the layers' running statistics and step counts into
    stacked buffers (the modules' buffers become views of them, so saving, loading and stock's own ``train()`` see them
    as before); the affine parameters are views of the flat buffer that holds them.

    :param layers: the layers, same hyperparameters
    :param flat: the flat buffer holding their parameters side by side
    """

    def __init__(self, layers: list[BatchRenorm1d], flat: FlatParameters) -> None:
        first = layers[0]
        keys = ("num_features", "eps", "momentum", "rmax", "dmax", "warmup_steps", "affine")
        if any(getattr(m, k) != getattr(first, k) for m in layers for k in keys):
            raise ValueError("stacked BatchRenorm1d layers must share their hyperparameters")
        self.layers, self.first = layers, first
        self.training = True
        self.scale = self.bias = self.grad_scale = self.grad_bias = None
        # one layer runs on [n, F] blocks (statistics [1, F]), several on [G, n, F] ones (statistics [G, 1, F])
        shaped: Callable[[th.Tensor], th.Tensor] = (lambda t: t) if len(layers) == 1 else (lambda t: t.unsqueeze(1))
        if first.affine:
            self.scale, self.bias = (shaped(flat.stacked([getattr(m, k) for m in layers])) for k in ("scale", "bias"))
            self.grad_scale, self.grad_bias = (
                shaped(flat.stacked([getattr(m, k) for m in layers], grad=True)) for k in ("scale", "bias")
            )
        buffers = [(m.ra_mean, m.ra_var, m.steps) for m in layers]
        if len(layers) == 1:  # views of the layer's own buffers
            ra_mean, ra_var, steps = cast(tuple[th.Tensor, th.Tensor, th.Tensor], buffers[0])
            self.ra_mean, self.ra_var, self.steps = ra_mean.view(1, -1), ra_var.view(1, -1), steps.view(1)
        else:
            with th.no_grad():
                self.ra_mean, self.ra_var, self.steps = (th.stack(list(t)) for t in zip(*buffers, strict=True))  # type: ignore[arg-type]
                self.ra_mean, self.ra_var = self.ra_mean.unsqueeze(1), self.ra_var.unsqueeze(1)
            for g, m in enumerate(layers):
                m.ra_mean, m.ra_var, m.steps = self.ra_mean[g, 0], self.ra_var[g, 0], self.steps[g]
        kept = [t for g in range(len(layers)) for t in (self.ra_mean[g], self.ra_var[g], self.steps[g])]
        self._pointers = [t.data_ptr() for t in kept]
        self.counts: RenormCounts | None = None
        self._saved: RenormSaved | None = None
        self._factor: th.Tensor | None = None
        self._constants: RenormConstants | None = None
        # per input shape: the kept blocks and the layer's constants for that row count
        self._buffers: dict[tuple[int, ...], tuple[RenormBuffers, RenormConstants]] = {}
        self._last: RenormBuffers | None = None
        # the next layer's weight times its gradient, kept: measured in a step, the product into a fresh [2, 256, 256]
        # block took ~280 us against ~35 us into a kept one
        self._products: th.Tensor | None = None

    def _buffers_for(self, x: th.Tensor) -> tuple[RenormBuffers, RenormConstants]:
        found = self._buffers.get(tuple(x.shape))
        if found is None:
            found = self._buffers[tuple(x.shape)] = (RenormBuffers.like(x), renorm_constants(self.first, x))
        self._last = found[0]
        return found

    def is_bound(self) -> bool:
        """:return: whether the modules' statistics still live in the kept buffers (``module.to()`` undoes it)"""
        found = [m._buffers[k] for m in self.layers for k in ("ra_mean", "ra_var", "steps")]
        return [t.data_ptr() if t is not None else 0 for t in found] == self._pointers

    def forward(self, x: th.Tensor) -> th.Tensor:
        """
        :return: the layers' output of ``x`` (``[n, F]`` or ``[G, n, F]``; in training mode, the running statistics and
            the counts updated)
        """
        buffers, constants = self._buffers_for(x)
        self._constants = constants
        if not self.training:
            y, self._factor = eval_renorm(x, self.ra_mean, self.ra_var, self.scale, self.bias, constants.eps, buffers)
            return y
        counts = self.counts
        assert counts is not None, "set the train() call's counts first"
        first = self.first
        steps = counts.steps[id(first)]
        stats = batch_statistics(x, self.ra_mean, self.ra_var, steps > first.warmup_steps, first, constants, buffers)
        self.steps += 1
        for m in self.layers:
            counts.steps[id(m)] = steps + 1
        y, self._saved = renorm_output(stats, self.scale, self.bias, constants, buffers)
        return y

    def backward(self, grad: th.Tensor, input_grad: bool) -> th.Tensor | None:
        """
        In training mode, write the scale and bias gradients of the last :meth:`forward` given its output's gradient
        ``grad``; in evaluation mode, nothing (no parameter trains through it).

        :return: the gradient of its input when ``input_grad``, else ``None``
        """
        if not self.training:
            assert self._factor is not None, "backward before forward"
            return th.mul(grad, self._factor, out=self._last.grad_x) if input_grad and self._last else None
        assert self._saved is not None and self._constants is not None, "backward before forward"
        # the affine parameters' gradients straight into the flat gradient buffer's views
        return renorm_backward(self._saved, grad, input_grad, self._constants, self._last, self.grad_scale, self.grad_bias)[0]

    def centred(self) -> th.Tensor | None:
        """:return: the last training-mode forward's centred input (what :meth:`backward_linear` wants), else ``None``"""
        return self._saved.centred if self.training and self._saved is not None else None

    def backward_linear(
        self, d: th.Tensor, weight: th.Tensor, grad_weight: th.Tensor, grad_bias: th.Tensor, grad_y: th.Tensor | None
    ) -> th.Tensor:
        """
        The training-mode backward when the output ``y`` feeds a ``Linear`` layer, with the two column sums over the
        block taken from that layer's gradients (docs/maths.md, "CrossQ batch renormalisation", "Through the next
        layer"): ``sum(dy) = sum(d) W`` and ``sum(dy * centred) = sum_j W * (d^T centred)``.

        :param d: the gradient of the layer's output (``[G, n, out]``, or ``[n, out]`` for one layer)
        :param weight: the layer's weight ``[G, out, F]`` (or ``[out, F]``)
        :param grad_weight: holds ``d^T @ centred`` (:meth:`centred`); becomes the weight's gradient ``d^T @ y``
        :param grad_bias: the layer's bias gradient ``sum(d)`` (``[G, out]`` or ``[out]``)
        :param grad_y: ``d @ weight``, the output's gradient, or ``None`` for a one-unit layer (``out == 1``): made
            here as an outer product, fused into the input gradient's first pass
        :return: the gradient of the input
        """
        saved, constants = self._saved, self._constants
        assert self.training and saved is not None and constants is not None and self._last is not None
        sum_grad = th.matmul(grad_bias.unsqueeze(-2), weight)
        if self._products is None or self._products.shape != weight.shape:
            with th.inference_mode(False):  # a normal tensor, usable in any mode
                self._products = th.empty_like(weight)
        sum_grad_centred = th.sum(th.mul(weight, grad_weight, out=self._products), dim=-2, keepdim=True)
        # the weight's gradient d^T (centred * factor + offset), from d^T centred
        grad_weight.mul_(saved.factor).addcmul_(grad_bias.unsqueeze(-1), saved.offset)
        terms = renorm_backward_from_sums(saved, sum_grad, sum_grad_centred, True, constants)
        assert terms is not None
        if self.grad_scale is not None and self.grad_bias is not None:
            self.grad_scale.copy_(sum_grad_centred)
            self.grad_bias.copy_(sum_grad)
        out = self._last.grad_x
        if grad_y is None:
            grad_x = th.addcmul(terms.mean_term, d, th.mul(weight, saved.factor), out=out)
        else:
            grad_x = th.addcmul(terms.mean_term, grad_y, saved.factor, out=out)
        return grad_x.addcmul_(saved.centred, terms.alpha)
