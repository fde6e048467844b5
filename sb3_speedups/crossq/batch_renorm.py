"""
sb3-contrib's ``BatchRenorm1d`` layers run as functions, with the train/eval choice passed in rather than read from
the modules' flags, and the costs of the module's training-mode forward and of its autograd backward cut:

- the batch variance is the centred sum of squares over ``n - 1`` (``x.var(dim=0)``'s value, another summation order:
  float32 rounding); torch's CPU ``var`` over the rows of a ``[512, 256]`` block costs about as much as a
  ``256 x 256`` product of it, the two reductions here about a fourteenth of that;
- the output and its gradients are one autograd node with a hand-derived backward (:class:`BatchRenormTraining`);
- the warm-up test (``steps > warmup_steps``) reads a host count kept per ``train()`` call (:class:`RenormCounts`),
  not the ``steps`` buffer each forward (a device sync on a GPU).

The running statistics and the ``steps`` buffer are updated in place as the module updates them, so saved models,
``predict`` and stock's own ``train()`` see what they would see after stock's steps. For acting, :class:`EvalRenormMlp`
runs a network with these layers in evaluation mode on a frozen copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch as th
from sb3_contrib.common.torch_layers import BatchRenorm1d
from torch import nn
from torch.nn import functional as F

from sb3_speedups.common.acting.torch_mlp import TorchMlp


class RenormCounts:
    """
    The ``steps`` of some ``BatchRenorm1d`` layers as host integers, read once from their buffers.

    :param modules: the networks whose layers are counted
    """

    def __init__(self, *modules: nn.Module) -> None:
        self.layers = [m for module in modules for m in module.modules() if isinstance(m, BatchRenorm1d)]
        self.steps = {id(m): int(m.steps) for m in self.layers}  # type: ignore[arg-type]

    def set_training(self, mode: bool) -> None:
        """Set the layers' ``training`` flags (stock's ``set_bn_training_mode``) without ``nn.Module.train``'s walk."""
        for m in self.layers:
            object.__setattr__(m, "training", mode)


@dataclass
class BatchStatistics:
    """A training-mode forward's statistics of its ``[n, features]`` input (computed without autograd)."""

    #: ``x - batch_mean``
    centred: th.Tensor
    batch_mean: th.Tensor
    #: the unbiased variance (``x.var(dim=0)``'s value)
    batch_var: th.Tensor
    #: after warm-up, the clamped corrections ``r`` (scale) and ``d`` (shift); ``None`` during warm-up
    r: th.Tensor | None = None
    d: th.Tensor | None = None


class BatchRenormTraining(th.autograd.Function):
    """
    A ``BatchRenorm1d`` layer's training-mode output from its batch statistics, with its gradients by hand
    (docs/maths.md, "CrossQ batch renormalisation"). The output is one fused pass over the centred block,
    ``centred * (scale / std) + (bias + scale * shift / std)`` (stock divides, multiplies and adds: float32 rounding
    apart, the same numbers), and the backward two reductions and two fused passes, about a third of the passes over
    the ``[n, features]`` block that autograd makes through the module's operations.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, x: th.Tensor, scale: th.Tensor | None, bias: th.Tensor | None, stats: BatchStatistics, eps: float
    ) -> th.Tensor:
        n = x.shape[0]
        if stats.r is None or stats.d is None:
            std = (stats.batch_var + eps).sqrt()
            shift = coefficient = None  # custom_mean is the batch mean
        else:
            sigma = stats.batch_var.sqrt()
            shift = stats.d * sigma / stats.r  # batch_mean - custom_mean
            std = (stats.batch_var / (stats.r**2) + eps).sqrt()
            # the factor of the gradient's term through sigma in custom_mean (a constant feature, sigma = 0, makes it
            # inf or nan, as stock's sqrt backward does)
            coefficient = stats.d / (stats.r * sigma * (n - 1))
        factor = 1.0 / std if scale is None else scale / std
        offset = th.zeros_like(std) if bias is None else bias
        if shift is not None:
            offset = offset + shift * factor
        ctx.save_for_backward(stats.centred, std, factor, scale, shift, coefficient, stats.r)
        return th.addcmul(offset, stats.centred, factor)

    @staticmethod
    def backward(ctx: Any, grad: th.Tensor) -> tuple[th.Tensor | None, ...]:  # type: ignore[override]
        centred, std, factor, scale, shift, coefficient, r = ctx.saved_tensors
        n = grad.shape[0]
        grad_bias = grad.sum(dim=0)
        # sum(grad * normalised) with normalised = (centred + shift) / std
        grad_scale = th.sum(grad * centred, dim=0)
        if shift is not None:
            grad_scale += shift * grad_bias
        grad_scale /= std
        grad_x = None
        if ctx.needs_input_grad[0]:
            # g = grad * scale is dL/d normalised: its sums from the affine parameters' gradients
            sum_g, sum_gn = (grad_bias, grad_scale) if scale is None else (grad_bias * scale, grad_scale * scale)
            alpha = sum_gn / ((n - 1) * std)
            alpha = -alpha if coefficient is None else coefficient * sum_g - alpha / (r**2)
            # (g - mean(g) + centred * alpha) / std, in two fused passes
            grad_x = th.addcmul(-sum_g / (n * std), grad, factor).addcmul_(centred, alpha / std)
        if scale is None:
            return grad_x, None, None, None, None
        return grad_x, grad_scale, grad_bias, None, None


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
        # (x - ra_mean) * (scale / sqrt(ra_var + eps)) + bias in two passes (stock's four round otherwise in float32)
        factor = 1.0 / (ra_var + eps).sqrt() if scale is None else scale / (ra_var + eps).sqrt()
        return th.addcmul(th.zeros_like(ra_mean) if bias is None else bias, x - ra_mean, factor)
    steps = counts.steps[id(layer)]
    with th.no_grad():
        batch_mean = x.mean(dim=0)
        centred = x - batch_mean
        stats = BatchStatistics(centred, batch_mean, th.sum(centred * centred, dim=0) / (x.shape[0] - 1))
        if steps > layer.warmup_steps:
            running_std = (ra_var + eps).sqrt()
            stats.r = ((stats.batch_var + eps).sqrt() / running_std).clamp(1 / layer.rmax, layer.rmax)
            stats.d = ((batch_mean - ra_mean) / running_std).clamp(-layer.dmax, layer.dmax)
        ra_mean += layer.momentum * (batch_mean - ra_mean)
        ra_var += layer.momentum * (stats.batch_var - ra_var)
        steps_buffer += 1
    counts.steps[id(layer)] = steps + 1
    y = BatchRenormTraining.apply(x, scale, bias, stats, eps)
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


class EvalRenormMlp:
    """
    A network of ``Linear``, activation and ``BatchRenorm1d`` layers in evaluation mode on plain (mirrored) tensors,
    for acting: the runs of ``Linear`` and activation layers are :class:`~sb3_speedups.common.acting.torch_mlp.TorchMlp`
    executors, each ``BatchRenorm1d`` layer the module's own evaluation forward (the same operations on the same
    shapes, so stock's numbers).

    :param net: the network (CrossQ's ``actor.latent_pi``)
    :param mirror: maps each source parameter or running statistic to its plain-tensor copy
    """

    def __init__(self, net: nn.Sequential, mirror: Callable[[th.Tensor], th.Tensor]) -> None:
        self.steps: list[Callable[[th.Tensor], th.Tensor]] = []
        run: list[nn.Module] = []
        for layer in [*net, None]:
            if layer is not None and not isinstance(layer, BatchRenorm1d):
                run.append(layer)
                continue
            if run:
                self.steps.append(TorchMlp.from_module(nn.Sequential(*run), mirror))
                run = []
            if layer is not None:
                self.steps.append(_EvalRenorm(layer, mirror))

    @classmethod
    def from_module(cls, net: nn.Module, mirror: Callable[[th.Tensor], th.Tensor]) -> EvalRenormMlp | TorchMlp:
        """:return: the executor of ``net`` (a plain :class:`TorchMlp` when it has no ``BatchRenorm1d`` layer)"""
        if isinstance(net, nn.Sequential) and any(isinstance(m, BatchRenorm1d) for m in net):
            return cls(net, mirror)
        return TorchMlp.from_module(net, mirror)

    def __call__(self, x: th.Tensor) -> th.Tensor:
        """:return: the network's output of inputs ``[n, in]``"""
        for step in self.steps:
            x = step(x)
        return x


class _EvalRenorm:
    """One ``BatchRenorm1d`` layer's evaluation forward on mirrored tensors (``BatchRenorm.forward``'s operations)."""

    def __init__(self, layer: BatchRenorm1d, mirror: Callable[[th.Tensor], th.Tensor]) -> None:
        assert isinstance(layer.ra_mean, th.Tensor) and isinstance(layer.ra_var, th.Tensor)
        self.mean, self.var, self.eps = mirror(layer.ra_mean)[None], mirror(layer.ra_var)[None], layer.eps
        self.affine = (mirror(layer.scale), mirror(layer.bias)) if layer.affine else None

    def __call__(self, x: th.Tensor) -> th.Tensor:
        x = (x - self.mean) / (self.var + self.eps).sqrt()
        return x if self.affine is None else self.affine[0] * x + self.affine[1]
