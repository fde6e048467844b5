"""
sb3-contrib's ``BatchRenorm1d`` layers run as functions, with the train/eval choice passed in rather than read from
the modules' flags, and the costs of the module's training-mode forward and of its autograd backward cut:

- the batch variance is the centred sum of squares over ``n - 1`` (``x.var(dim=0)``'s value, another summation order:
  float32 rounding); torch's CPU ``var`` over the rows of a ``[512, 256]`` block costs about as much as a
  ``256 x 256`` product of it, the two reductions here about a fourteenth of that;
- the output and its gradients are hand-derived (:func:`renorm_output`, :func:`renorm_backward`): one autograd node
  (:class:`BatchRenormTraining`), or an input norm of :class:`~sb3_speedups.common.nn.training.MlpChain` for ``G``
  layers at once (:class:`~sb3_speedups.crossq.stacked_renorm.StackedRenorm`, CrossQ's hand-derived step);
- the warm-up test (``steps > warmup_steps``) reads a host count kept per ``train()`` call (:class:`RenormCounts`),
  not the ``steps`` buffer each forward (a device sync on a GPU).

The running statistics and the ``steps`` buffer are updated in place as the module updates them, so saved models,
``predict`` and stock's own ``train()`` see what they would see after stock's steps. For acting:
:mod:`sb3_speedups.crossq.acting`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch as th
from sb3_contrib.common.torch_layers import BatchRenorm1d
from torch import nn
from torch.nn import functional as F


class RenormCounts:
    """
    The ``steps`` of some ``BatchRenorm1d`` layers as host integers, read once from their buffers.

    :param modules: the networks whose layers are counted
    :param layers: the layers themselves instead (found once, for calls every ``train()``)
    """

    def __init__(self, *modules: nn.Module, layers: list[BatchRenorm1d] | None = None) -> None:
        if layers is None:
            layers = [m for module in modules for m in module.modules() if isinstance(m, BatchRenorm1d)]
        self.layers = layers
        # one host read for all of them
        values = th.stack([m.steps for m in layers]).tolist() if layers else []  # type: ignore[misc]
        self.steps: dict[int, int] = {id(m): int(v) for m, v in zip(layers, values, strict=True)}

    def set_training(self, mode: bool) -> None:
        """Set the layers' ``training`` flags (stock's ``set_bn_training_mode``) without ``nn.Module.train``'s walk."""
        for m in self.layers:
            object.__setattr__(m, "training", mode)


@dataclass
class BatchStatistics:
    """
    A training-mode forward's statistics of its input, rows on dimension ``-2`` (``[n, F]``, or ``[G, n, F]`` for
    ``G`` layers at once), each statistic ``[..., 1, F]`` (computed without autograd).
    """

    #: ``x - batch_mean``
    centred: th.Tensor
    batch_mean: th.Tensor
    #: the unbiased variance (``x.var(dim=-2)``'s value)
    batch_var: th.Tensor
    #: after warm-up, the clamped corrections ``r`` (scale) and ``d`` (shift); ``None`` during warm-up
    r: th.Tensor | None = None
    d: th.Tensor | None = None


@dataclass(frozen=True)
class RenormConstants:
    """
    A layer's numbers as kept 0-dim tensors of its input's dtype: an op given a Python number wraps and converts it at
    every call, and the statistics' ops are many and small (the same values: a float32 op casts the number to float32).
    """

    eps: th.Tensor
    momentum: th.Tensor
    #: the row count ``n``, and ``n - 1``
    n: th.Tensor
    n_minus_1: th.Tensor


_CONSTANTS: dict[tuple[float, float, int, th.device, th.dtype], RenormConstants] = {}


def renorm_constants(layer: BatchRenorm1d, x: th.Tensor) -> RenormConstants:
    """:return: the constants of ``layer`` for inputs shaped and typed as ``x`` (rows on dimension ``-2``), made once"""
    n = x.shape[-2]
    key = (layer.eps, layer.momentum, n, x.device, x.dtype)
    found = _CONSTANTS.get(key)
    if found is None:
        with th.inference_mode(False):  # normal tensors, usable in any mode
            values = (layer.eps, layer.momentum, n, n - 1)
            made = (th.tensor(float(v), dtype=x.dtype, device=x.device) for v in values)
            found = _CONSTANTS[key] = RenormConstants(*made)
    return found


@dataclass
class RenormBuffers:
    """
    Kept ``[..., n, F]`` blocks for the functions below to write into (fresh blocks of a megabyte cost page faults
    whenever the allocator has returned its memory), or ``None`` there: they allocate.
    """

    centred: th.Tensor
    #: a temporary (the squares of the centred block, the products of the gradient with it)
    scratch: th.Tensor
    output: th.Tensor
    grad_x: th.Tensor

    @classmethod
    @th.inference_mode(False)
    def like(cls, x: th.Tensor) -> RenormBuffers:
        """:return: buffers for inputs shaped as ``x`` (normal tensors, usable in any mode)"""
        return cls(*(th.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(4)))


def batch_statistics(
    x: th.Tensor,
    ra_mean: th.Tensor,
    ra_var: th.Tensor,
    warm: bool,
    layer: BatchRenorm1d,
    constants: RenormConstants,
    buffers: RenormBuffers | None = None,
) -> BatchStatistics:
    """
    :param x: the input, rows on dimension ``-2`` (not tracked by autograd)
    :param ra_mean: the running mean, ``[..., 1, F]``, updated in place (as the module updates its own)
    :param ra_var: the running variance, likewise
    :param warm: past the warm-up (``steps > warmup_steps``): renormalise with the running statistics
    :param layer: the layer (or one of the ``G``) whose hyperparameters these are
    :param constants: its :func:`renorm_constants` for ``x``
    :param buffers: where to write the centred block and the temporary
    :return: the batch statistics of ``x``
    """
    batch_mean = x.mean(dim=-2, keepdim=True)
    if buffers is None:
        centred = x - batch_mean
        square = centred * centred
    else:
        centred = th.sub(x, batch_mean, out=buffers.centred)
        square = th.mul(centred, centred, out=buffers.scratch)
    stats = BatchStatistics(centred, batch_mean, th.sum(square, dim=-2, keepdim=True).div_(constants.n_minus_1))
    if warm:
        running_std = th.add(ra_var, constants.eps).sqrt_()
        r = th.add(stats.batch_var, constants.eps).sqrt_().div_(running_std)
        stats.r = r.clamp_(1 / layer.rmax, layer.rmax)
        stats.d = th.sub(batch_mean, ra_mean).div_(running_std).clamp_(-layer.dmax, layer.dmax)
    ra_mean += th.sub(batch_mean, ra_mean).mul_(constants.momentum)
    ra_var += th.sub(stats.batch_var, ra_var).mul_(constants.momentum)
    return stats


@dataclass
class RenormSaved:
    """What a training-mode output keeps for its backward (:func:`renorm_output`, :func:`renorm_backward`)."""

    centred: th.Tensor
    std: th.Tensor
    #: ``scale / std`` (``1 / std`` without the affine parameters)
    factor: th.Tensor
    scale: th.Tensor | None
    #: ``batch_mean - custom_mean`` after warm-up, else ``None``
    shift: th.Tensor | None
    coefficient: th.Tensor | None
    r: th.Tensor | None
    #: the output is ``centred * factor + offset``
    offset: th.Tensor


def renorm_output(
    stats: BatchStatistics,
    scale: th.Tensor | None,
    bias: th.Tensor | None,
    constants: RenormConstants,
    buffers: RenormBuffers | None = None,
) -> tuple[th.Tensor, RenormSaved]:
    """
    A ``BatchRenorm1d`` layer's training-mode output from its batch statistics (docs/maths.md, "CrossQ batch
    renormalisation"): one fused pass over the centred block, ``centred * (scale / std) + (bias + scale * shift /
    std)`` (stock divides, multiplies and adds: float32 rounding apart, the same numbers).

    :param scale: the affine scale, broadcastable to the statistics (or ``None``)
    :param bias: the affine bias, likewise
    :param constants: the layer's :func:`renorm_constants`
    :param buffers: where to write the output
    :return: the output, and what its backward needs
    """
    if stats.r is None or stats.d is None:
        std = th.add(stats.batch_var, constants.eps).sqrt_()
        shift = coefficient = None  # custom_mean is the batch mean
    else:
        sigma = stats.batch_var.sqrt()
        shift = stats.d * sigma / stats.r  # batch_mean - custom_mean
        std = th.add(stats.batch_var / (stats.r**2), constants.eps).sqrt_()
        # the factor of the gradient's term through sigma in custom_mean (a constant feature, sigma = 0, makes it
        # inf or nan, as stock's sqrt backward does)
        coefficient = stats.d / (stats.r * sigma).mul_(constants.n_minus_1)
    factor = 1.0 / std if scale is None else scale / std
    offset = th.zeros_like(std) if bias is None else bias
    if shift is not None:
        offset = offset + shift * factor
    saved = RenormSaved(stats.centred, std, factor, scale, shift, coefficient, stats.r, offset)
    if buffers is None:
        return th.addcmul(offset, stats.centred, factor), saved
    return th.addcmul(offset, stats.centred, factor, out=buffers.output), saved


def renorm_backward(
    saved: RenormSaved,
    grad: th.Tensor,
    input_grad: bool,
    constants: RenormConstants,
    buffers: RenormBuffers | None = None,
    grad_scale_out: th.Tensor | None = None,
    grad_bias_out: th.Tensor | None = None,
) -> tuple[th.Tensor | None, th.Tensor, th.Tensor]:
    """
    The gradients of :func:`renorm_output`: two reductions over the rows and two fused passes, about a third of the
    passes over the block that autograd makes through the module's operations.

    :param grad: the gradient of the output
    :param input_grad: compute the input's gradient too
    :param constants: the layer's :func:`renorm_constants`
    :param buffers: where to write the temporary and the input's gradient
    :param grad_scale_out: where to write the scale's gradient (statistic-shaped), or ``None``: a new tensor
    :param grad_bias_out: likewise, the bias's
    :return: the gradients of the input (or ``None``), of the scale and of the bias, each statistic-shaped
    """
    grad_bias = th.sum(grad, dim=-2, keepdim=True, out=grad_bias_out)
    # sum(grad * normalised) with normalised = (centred + shift) / std
    product = grad * saved.centred if buffers is None else th.mul(grad, saved.centred, out=buffers.scratch)
    grad_scale = th.sum(product, dim=-2, keepdim=True, out=grad_scale_out)
    terms = renorm_backward_from_sums(saved, grad_bias, grad_scale, input_grad, constants)
    if terms is None:
        return None, grad_scale, grad_bias
    out = None if buffers is None else buffers.grad_x
    grad_x = th.addcmul(terms.mean_term, grad, saved.factor, out=out)  # type: ignore[arg-type]
    return grad_x.addcmul_(saved.centred, terms.alpha), grad_scale, grad_bias


@dataclass
class InputGradTerms:
    """The input's gradient of a training-mode output is ``grad * factor + mean_term + centred * alpha``."""

    mean_term: th.Tensor
    alpha: th.Tensor


def renorm_backward_from_sums(
    saved: RenormSaved,
    grad_bias: th.Tensor,
    grad_scale: th.Tensor,
    input_grad: bool,
    constants: RenormConstants,
) -> InputGradTerms | None:
    """
    The part of :func:`renorm_backward` after its two column sums, on the statistic-shaped tensors only.

    :param grad_bias: the output gradient's column sums ``sum(grad)`` (the bias's gradient)
    :param grad_scale: ``sum(grad * centred)``, turned in place into the scale's gradient
    :param input_grad: return the terms of the input's gradient too
    :param constants: the layer's :func:`renorm_constants`
    :return: those terms, or ``None`` without ``input_grad``
    """
    std, scale, shift = saved.std, saved.scale, saved.shift
    if shift is not None:
        grad_scale += shift * grad_bias
    grad_scale /= std
    if not input_grad:
        return None
    # g = grad * scale is dL/d normalised: its sums from the affine parameters' gradients
    sum_g, sum_gn = (grad_bias, grad_scale) if scale is None else (grad_bias * scale, grad_scale * scale)
    alpha = th.div(sum_gn, th.mul(std, constants.n_minus_1))
    if saved.coefficient is None or saved.r is None:
        alpha.neg_()
    else:
        alpha = saved.coefficient * sum_g - alpha / (saved.r**2)
    # (g - mean(g) + centred * alpha) / std, in two fused passes
    return InputGradTerms(th.neg(sum_g).div_(th.mul(std, constants.n)), alpha.div_(std))


class BatchRenormTraining(th.autograd.Function):
    """One ``BatchRenorm1d`` layer's training-mode output as an autograd node (:func:`renorm_output`, its backward)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: th.Tensor,
        scale: th.Tensor | None,
        bias: th.Tensor | None,
        stats: BatchStatistics,
        constants: RenormConstants,
    ) -> th.Tensor:
        y, ctx.saved = renorm_output(stats, scale, bias, constants)
        ctx.constants = constants
        return y

    @staticmethod
    def backward(ctx: Any, grad: th.Tensor) -> tuple[th.Tensor | None, ...]:  # type: ignore[override]
        saved: RenormSaved = ctx.saved
        grad_x, grad_scale, grad_bias = renorm_backward(saved, grad, ctx.needs_input_grad[0], ctx.constants)
        if saved.scale is None:
            return grad_x, None, None, None, None
        return grad_x, grad_scale.view_as(saved.scale), grad_bias.view_as(saved.scale), None, None


def eval_renorm(
    x: th.Tensor,
    ra_mean: th.Tensor,
    ra_var: th.Tensor,
    scale: th.Tensor | None,
    bias: th.Tensor | None,
    eps: float | th.Tensor,
    buffers: RenormBuffers | None = None,
) -> tuple[th.Tensor, th.Tensor]:
    """
    :param eps: the layer's ``eps`` (or its kept tensor, :class:`RenormConstants`)
    :return: a ``BatchRenorm1d`` layer's evaluation-mode output, ``(x - ra_mean) * (scale / sqrt(ra_var + eps)) + bias``
        in two passes (stock's four round otherwise in float32), and its factor (the output's derivative in ``x``)
    """
    std = th.add(ra_var, eps).sqrt_()
    factor = 1.0 / std if scale is None else th.div(scale, std)
    offset = th.zeros_like(ra_mean) if bias is None else bias
    if buffers is None:
        return th.addcmul(offset, x - ra_mean, factor), factor
    centred = th.sub(x, ra_mean, out=buffers.centred)
    return th.addcmul(offset, centred, factor, out=buffers.output), factor


def batch_renorm(layer: BatchRenorm1d, x: th.Tensor, training: bool, counts: RenormCounts) -> th.Tensor:
    """
    :return: ``layer(x)`` as the layer computes it in training mode (``training``: batch statistics, the running ones
        updated) or evaluation mode (the running statistics)
    """
    eps = layer.eps
    ra_mean, ra_var, steps_buffer = layer.ra_mean, layer.ra_var, layer.steps
    assert isinstance(ra_mean, th.Tensor) and isinstance(ra_var, th.Tensor) and isinstance(steps_buffer, th.Tensor)
    scale, bias = (layer.scale, layer.bias) if layer.affine else (None, None)
    if not training:
        return eval_renorm(x, ra_mean, ra_var, scale, bias, eps)[0]
    steps = counts.steps[id(layer)]
    constants = renorm_constants(layer, x)
    with th.no_grad():
        stats = batch_statistics(x, ra_mean.view(1, -1), ra_var.view(1, -1), steps > layer.warmup_steps, layer, constants)
        steps_buffer += 1
    counts.steps[id(layer)] = steps + 1
    y = BatchRenormTraining.apply(x, scale, bias, stats, constants)
    assert isinstance(y, th.Tensor)
    return y


def run_sequential(net: nn.Sequential, x: th.Tensor, training: bool, counts: RenormCounts) -> th.Tensor:
    """
    :param net: ``Linear``, ``BatchRenorm1d`` and parameter-free (activation) layers
        (:func:`~sb3_speedups.crossq.update.crossq_unsupported_reason` checks)
    :param training: run the ``BatchRenorm1d`` layers in training mode
    :return: ``net(x)`` with its ``BatchRenorm1d`` layers in training (``training``) or evaluation mode
    """
    for layer in net:
        if isinstance(layer, BatchRenorm1d):
            x = batch_renorm(layer, x, training, counts)
        elif isinstance(layer, nn.Linear):
            x = F.linear(x, layer.weight, layer.bias)
        else:
            x = layer(x)
    return x
