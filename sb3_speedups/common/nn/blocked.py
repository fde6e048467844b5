"""
The blocked executor of an MLP description (:mod:`sb3_speedups.common.nn.mlp`): the forward of many rows, a block
at a time, into buffers kept from call to call.
"""

from __future__ import annotations

import torch as th
from torch import nn

from sb3_speedups.common.nn.mlp import Mlp, parse_output_mlp


class BufferedMlpForward:
    """
    ``mlp(x)`` for ``Linear`` layers with ReLU or Tanh between them (an SB3 ``QNetwork.q_net``), ``rows`` rows at a
    time, into buffers kept from call to call. Same operations as the module's own forward (``addmm``, then torch's
    activation in place), so the same values.

    Why not just call the module: its activations are fresh tensors of hundreds of KB on every call, and once glibc's
    dynamic mmap threshold has risen above their size they come from the heap, where longer-lived small allocations
    split the freed blocks and the process keeps growing.

    :param mlp: the network on the module's own parameters (read at each call, so it follows training), from
        :func:`~sb3_speedups.common.nn.mlp.parse_output_mlp`
    :param rows: rows per block (activations of thousands of rows spill out of the CPU caches)
    """

    def __init__(self, mlp: Mlp, rows: int = 1024) -> None:
        if any(layer.activation.torch_ is None for layer in mlp.layers) or any(layer.bias is None for layer in mlp.layers):
            raise ValueError("unsupported MLP: every layer needs a bias and an activation with an in-place kernel")
        self.layers, self.rows = mlp.layers, rows
        self._hidden: dict[int, list[th.Tensor]] = {}
        self._out: dict[int, th.Tensor] = {}

    @classmethod
    def from_sequential(cls, seq: nn.Module, rows: int = 1024) -> BufferedMlpForward | None:
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
            self._out[n] = th.empty(n, self.layers[-1].weight.shape[0], dtype=like.dtype, device=like.device)
        if block not in self._hidden:
            if len(self._hidden) > 8:
                self._hidden.clear()
            self._hidden[block] = [
                th.empty(block, layer.weight.shape[0], dtype=like.dtype, device=like.device) for layer in self.layers[:-1]
            ]
        return self._out[n], self._hidden[block]

    @th.no_grad()
    def __call__(self, x: th.Tensor) -> th.Tensor:
        """
        :param x: inputs ``[n, in]``
        :return: outputs ``[n, out]``, in a buffer that the next call with ``n`` rows overwrites
        """
        n = x.shape[0]
        out, _ = self._buffers(n, min(n, self.rows), x)
        last = len(self.layers) - 1
        for start in range(0, n, self.rows):
            h = x[start : start + self.rows]
            hidden = self._buffers(n, h.shape[0], x)[1]
            for k, layer in enumerate(self.layers):
                dst = out[start : start + h.shape[0]] if k == last else hidden[k]
                th.addmm(layer.bias, h, layer.weight.t(), out=dst)  # type: ignore[arg-type]
                layer.activation.torch_(dst)  # type: ignore[misc]
                h = dst
        return out
