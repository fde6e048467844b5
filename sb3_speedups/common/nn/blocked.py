"""
Forwards of many rows a block at a time (the activations of thousands of rows spill out of the CPU caches):
:class:`BlockedMlpForward`, the blocked executor of an MLP description (:mod:`sb3_speedups.common.nn.mlp`), into
buffers kept from call to call, and :func:`forward_in_blocks` for any row-wise module.
"""

from __future__ import annotations

from collections.abc import Callable

import torch as th
from torch import nn

from sb3_speedups.common.nn.mlp import Mlp, biases, parse_output_mlp


class BlockedMlpForward:
    """
    ``mlp(x)`` for ``Linear`` layers with ReLU or Tanh between them (an SB3 ``QNetwork.q_net``), ``rows`` rows at a
    time, into buffers kept from call to call. Same operations as the module's own forward (``addmm``, then torch's
    activation in place), so the same values.

    Why not just call the module: its activations are fresh tensors of hundreds of KB on every call, and once glibc's
    dynamic mmap threshold has risen above their size they come from the heap, where longer-lived small allocations
    split the freed blocks and the process keeps growing.

    :param mlp: the network on the module's own parameters (read at each call, so it follows training), from
        :func:`~sb3_speedups.common.nn.mlp.parse_output_mlp`; with a one-hot input the first layer is a gather of the
        hot columns' weights
    :param rows: rows per block (activations of thousands of rows spill out of the CPU caches)
    """

    def __init__(self, mlp: Mlp, rows: int = 1024) -> None:
        self.mlp = mlp
        self.weights, self.biases, self.rows = [layer.weight for layer in mlp.layers], biases(mlp.layers), rows
        self.affines: list[Callable[..., th.Tensor]] = [th.addmm] * len(self.weights)
        if mlp.one_hot is not None:
            self.affines[0] = mlp.one_hot.addmm
        self.activations: list[Callable[[th.Tensor], th.Tensor]] = []
        for layer in mlp.layers:
            if layer.activation.torch_ is None:
                raise ValueError(f"activation {layer.activation.name} has no in-place kernel")
            self.activations.append(layer.activation.torch_)
        self._hidden: dict[int, list[th.Tensor]] = {}
        self._out: dict[int, th.Tensor] = {}

    @classmethod
    def from_sequential(cls, seq: nn.Module, rows: int = 1024) -> BlockedMlpForward | None:
        """:return: the forward of ``Linear, act, ..., Linear`` (as ``QNetwork.q_net``), or ``None`` if not that"""
        mlp = parse_output_mlp(seq)
        return None if isinstance(mlp, str) else cls(mlp, rows)

    @th.inference_mode(False)
    def _buffers(self, n: int, block: int, like: th.Tensor) -> tuple[th.Tensor, list[th.Tensor]]:
        # Normal tensors even when called under inference mode, so that they can be written in any mode. Few distinct
        # sizes occur in a run (one per train() shape); the caches are emptied if that ever stops being true.
        if len(self._out) > 8:
            self._out.clear()
        if n not in self._out:
            self._out[n] = th.empty(n, self.weights[-1].shape[0], dtype=self.weights[-1].dtype, device=like.device)
        if block not in self._hidden:
            if len(self._hidden) > 8:
                self._hidden.clear()
            self._hidden[block] = [
                th.empty(block, weight.shape[0], dtype=weight.dtype, device=like.device) for weight in self.weights[:-1]
            ]
        return self._out[n], self._hidden[block]

    def __call__(self, x: th.Tensor) -> th.Tensor:
        """
        :param x: inputs ``[n, in]``, or a one-hot input's hot columns ``[n, k]``
        :return: outputs ``[n, out]``, in a buffer that the next call with ``n`` rows overwrites
        """
        if th.is_grad_enabled():
            with th.no_grad():
                return self(x)
        n = x.shape[0]
        out, hidden = self._buffers(n, min(n, self.rows), x)
        if n <= self.rows:
            return self._block(x, out, hidden)
        for start in range(0, n, self.rows):
            h = x[start : start + self.rows]
            if hidden and hidden[0].shape[0] != h.shape[0]:  # the last block is shorter
                hidden = self._buffers(n, h.shape[0], x)[1]
            self._block(h, out[start : start + h.shape[0]], hidden)
        return out

    def _block(self, h: th.Tensor, out: th.Tensor, hidden: list[th.Tensor]) -> th.Tensor:
        """:return: ``out``, the outputs of the rows ``h`` (``hidden``: buffers for their activations)"""
        layers = zip([*hidden, out], self.affines, self.weights, self.biases, self.activations, strict=True)
        for dst, affine, weight, bias, activation_ in layers:
            affine(bias, h, weight.t(), out=dst)
            activation_(dst)
            h = dst
        return out


def forward_in_blocks(net: nn.Module, x: th.Tensor, rows: int = 1024) -> th.Tensor:
    """
    ``net(x)`` computed ``rows`` rows at a time.

    :param net: a row-wise network (each output row depends only on its input row)
    :param x: the input batch
    :param rows: rows per call
    :return: the outputs, concatenated
    """
    if x.shape[0] <= rows:
        return net(x)
    return th.cat([net(x[i : i + rows]) for i in range(0, x.shape[0], rows)])
