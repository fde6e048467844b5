"""
CrossQ's actor for acting: a network of ``Linear``, activation and ``BatchRenorm1d`` layers in evaluation mode on a
frozen copy (:class:`~sb3_speedups.common.acting.off_policy.FrozenOffPolicyActor`), with the operations of the
modules' own forward (stock's ``predict``'s numbers).
"""

from __future__ import annotations

from collections.abc import Callable

import torch as th
from sb3_contrib.common.torch_layers import BatchRenorm1d
from torch import nn

from sb3_speedups.common.acting.torch_mlp import TorchMlp


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
