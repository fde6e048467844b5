"""
The torch acting executor of an MLP description (:mod:`sb3_speedups.common.nn.mlp`): the module's forward on plain
(for example mirrored) tensors, without module calls.
"""

from __future__ import annotations

from collections.abc import Callable

import torch as th
from torch import nn

from sb3_speedups.common.nn.mlp import NONE, Mlp, parse_mlp


def _matmul(bias: None, x: th.Tensor, weight_t: th.Tensor) -> th.Tensor:
    """:return: ``x @ weight_t``: a layer without a bias, called as ``addmm`` is"""
    return x @ weight_t


class TorchMlp:
    """
    An MLP run on the tensors of its description with the module's own kernels (``addmm``, torch's activations, in
    place on each layer's fresh output where they have an in-place kernel). Stacked (``G`` networks side by side), each
    layer is one ``baddbmm`` and the output is ``[G, n, out]``. With a one-hot input the first layer is a gather, and
    the input the hot columns (:meth:`~sb3_speedups.common.nn.mlp.Mlp.inputs`).

    :param mlp: the network, on the tensors to compute with (views: they follow their source, e.g. a mirror's sync)
    """

    def __init__(self, mlp: Mlp) -> None:
        self.mlp = mlp
        self.groups = mlp.layers[0].weight.shape[0] if mlp.stacked and mlp.one_hot is None else 0
        affine: Callable[..., th.Tensor] = th.baddbmm if mlp.stacked else th.addmm
        # (product, weight transposed, bias or None, activation or None), views made once
        self._layers: list[
            tuple[Callable[..., th.Tensor], th.Tensor, th.Tensor | None, Callable[[th.Tensor], th.Tensor] | None]
        ] = [
            (
                mlp.one_hot.addmm if k == 0 and mlp.one_hot is not None else affine if layer.bias is not None else _matmul,
                layer.weight.transpose(-2, -1),
                None if layer.bias is None else layer.bias.unsqueeze(1) if mlp.stacked else layer.bias,
                None if layer.activation is NONE else layer.activation.torch_ or layer.activation.torch,
            )
            for k, layer in enumerate(mlp.layers)
        ]

    @classmethod
    def from_module(cls, seq: nn.Module, mirror: Callable[[th.Tensor], th.Tensor]) -> TorchMlp:
        """
        :param seq: a module :func:`~sb3_speedups.common.nn.mlp.parse_mlp` accepts
        :param mirror: maps each source parameter to its plain-tensor copy (e.g. from a ``ParameterMirror``)
        """
        mlp = parse_mlp(seq)
        if isinstance(mlp, str):
            raise ValueError(f"not a plain MLP ({mlp}): {seq}")
        return cls(mlp.map(mirror))

    def __call__(self, x: th.Tensor) -> th.Tensor:
        """
        :return: the output ``[n, out]`` of inputs ``[n, in]`` or hot columns ``[n, k]`` (stacked: ``[G, n, out]``, of
            the same rows for every network, or of ``[G, n, in]``: each network's own rows)
        """
        if self.groups and x.dim() == 2:
            x = x.expand(self.groups, *x.shape)
        for affine, weight_t, bias, act in self._layers:
            x = affine(bias, x, weight_t)
            if act is not None:
                x = act(x)
        return x
