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


@th.no_grad()
def one_row_addmv_is_addmm(weight: th.Tensor, bias: th.Tensor | None) -> bool:
    """
    :return: whether ``addmv(bias, weight, x)`` gives the bits of ``addmm(bias, x[None], weight.T)`` (stock's
        ``Linear`` on one row) for this layer's shapes on this machine: checked on a few random rows, not assumed. It
        holds where the BLAS runs a one-row matrix product as its matrix-vector product (MKL on the CPUs measured:
        docs/benchmarks.md); a matrix-vector kernel of its own would differ in most rows of a few hundred inputs.
    """
    if bias is None or weight.device.type != "cpu" or weight.dim() != 2:
        return False
    rows = th.randn(4, weight.shape[1], generator=th.Generator().manual_seed(0), dtype=weight.dtype)
    return all(th.equal(th.addmm(bias, row[None], weight.t())[0], th.addmv(bias, weight, row)) for row in rows)


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
        # One row (one env) through plain layers: matrix-vector products, where this machine's addmv gives addmm's bits
        self._row_layers: list[tuple[th.Tensor, th.Tensor, Callable[[th.Tensor], th.Tensor] | None]] | None = None
        rows = [(layer.weight, layer.bias, act) for layer, (*_, act) in zip(mlp.layers, self._layers, strict=True)]
        if not mlp.stacked and mlp.one_hot is None and rows and all(one_row_addmv_is_addmm(w, b) for w, b, _ in rows):
            self._row_layers = [(w, b, act) for w, b, act in rows if b is not None]

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
        if self._row_layers is not None and x.shape[0] == 1 and x.dim() == 2:
            v = x[0]
            for w, b, row_act in self._row_layers:
                v = th.addmv(b, w, v)
                if row_act is not None:
                    v = row_act(v)
            return v.unsqueeze(0)
        if self.groups and x.dim() == 2:
            x = x.expand(self.groups, *x.shape)
        for affine, weight_t, bias, act in self._layers:
            x = affine(bias, x, weight_t)
            if act is not None:
                x = act(x)
        return x
