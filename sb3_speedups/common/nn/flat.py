"""
Flat parameter and gradient buffers.

The module keeps its own ``nn.Parameter`` objects (so ``state_dict``, saving and stock loading are untouched); only
their storage moves into one contiguous buffer, with one gradient buffer beside it. Gradient clipping then is one
norm, and an optimizer step one kernel call over the buffer (:mod:`sb3_speedups.common.nn.optim`), instead of a
Python loop over every tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch as th

from sb3_speedups.common.shared_memory import map_anonymous

#: element count that :class:`FlatParameters` aligns a parameter to (a multiple of any SIMD width in floats)
ALIGNMENT = 64


def shared_zeros(numel: int, dtype: th.dtype = th.float32) -> th.Tensor:
    """
    :return: a zeroed CPU tensor in anonymous shared memory: a process forked later reads and writes the same memory
        (``share_memory_()`` would move an existing storage and leave views made before it behind)
    """
    return th.frombuffer(map_anonymous(numel * th.empty((), dtype=dtype).element_size()), dtype=dtype, count=numel)


class FlatParameters:
    """
    Make ``params`` views into one flat data buffer, with one flat gradient buffer beside it.

    :param params: the parameters, in the module's (and optimizer's) order
    :param layout: the same parameters in the order to lay them out in the buffer (default: ``params``); laying
        out equally shaped tensors side by side lets callers use them as one stacked tensor (:meth:`stacked`)
    :param shared: allocate the buffers in shared memory (CPU only), for a process forked later to work on them
    :param aligned: a parameter of ``layout`` to start at a multiple of :data:`ALIGNMENT` elements (zeros pad the gap
        before it), so that an element-wise kernel run on the ranges before and from it computes every element as a
        run over the whole buffer does (vectorised kernels compute a range's unaligned tail another way)
    """

    def __init__(
        self,
        params: Sequence[th.Tensor],
        layout: Sequence[th.Tensor] | None = None,
        shared: bool = False,
        aligned: th.Tensor | None = None,
    ) -> None:
        self.params = list(params)
        layout = self.params if layout is None else list(layout)
        if {id(p) for p in layout} != {id(p) for p in self.params} or len(layout) != len(self.params):
            raise ValueError("layout must hold exactly the same parameters")
        first = self.params[0]
        if any(p.dtype != first.dtype or p.device != first.device for p in self.params):
            raise ValueError("all parameters must share one dtype and device")
        starts, total = {}, 0
        for p in layout:
            if p is aligned:
                total = -(-total // ALIGNMENT) * ALIGNMENT
            starts[id(p)] = total
            total += p.numel()
        if shared and first.device.type != "cpu":
            raise ValueError("shared flat buffers live in CPU memory")
        self.shared = shared
        if shared:
            self.data, self.grad = shared_zeros(total, first.dtype), shared_zeros(total, first.dtype)
        else:
            self.data = th.zeros(total, dtype=first.dtype, device=first.device)  # zeros: the gap before `aligned`
            self.grad = th.zeros(total, dtype=first.dtype, device=first.device)
        self._offsets: dict[int, int] = starts
        self._divisor: th.Tensor | None = None  # clip_divisor's on the CPU
        self._expected: tuple[int, list[int]] | None = None  # is_bound's data buffer address and parameter addresses
        with th.no_grad():
            for p in layout:
                view = self.view_of(self.data, p)
                view.copy_(p.data)
                p.data = view

    def offset(self, param: th.Tensor) -> int:
        """:return: where ``param`` starts in the flat buffers"""
        return self._offsets[id(param)]

    def data_of(self, param: th.Tensor) -> th.Tensor:
        """:return: the view of ``param`` in the data buffer (the parameter's own storage)"""
        return self.view_of(self.data, param)

    def grad_of(self, param: th.Tensor) -> th.Tensor:
        """:return: the view of ``param``'s gradient in the gradient buffer"""
        return self.view_of(self.grad, param)

    def view_of(self, buffer: th.Tensor, param: th.Tensor) -> th.Tensor:
        """
        :param buffer: a flat buffer laid out as the data buffer (data, gradient, an optimizer's moments)
        :param param: one of the parameters
        :return: ``param``'s part of ``buffer``, shaped and strided as ``param`` (a channels-last convolution weight
            stays channels-last, so element-wise steps over the buffers pair the same entries)
        """
        start = self.offset(param)
        part = buffer[start : start + param.numel()]
        return part.view_as(param) if param.is_contiguous() else part.as_strided(param.shape, param.stride())

    def stacked(self, params: Sequence[th.Tensor], grad: bool = False) -> th.Tensor:
        """
        :param params: equally shaped parameters laid out one after the other
        :param grad: view the gradient buffer instead of the data buffer
        :return: one ``[len(params), *shape]`` view over them
        """
        shape, start = params[0].shape, self.offset(params[0])
        for i, p in enumerate(params):
            if p.shape != shape or self.offset(p) != start + i * p.numel() or not p.is_contiguous():
                raise ValueError("stacked parameters must be equally shaped, contiguous and laid out side by side")
        buffer = self.grad if grad else self.data
        return buffer[start : start + len(params) * params[0].numel()].view(len(params), *shape)

    def is_bound(self) -> bool:
        """:return: whether every parameter still lives in the data buffer (``module.to()`` or ``p.data = ...`` undo it)"""
        # Cheap enough for every env step: one pointer per parameter against a list built once per buffer address.
        base = self.data.data_ptr()
        if self._expected is None or self._expected[0] != base:
            item = self.data.element_size()
            self._expected = (base, [base + self._offsets[id(p)] * item for p in self.params])
        return list(map(th.Tensor.data_ptr, self.params)) == self._expected[1]

    def attach_grads(self) -> None:
        """Set every ``param.grad`` to its view of the gradient buffer, so autograd accumulates into it."""
        for p in self.params:
            p.grad = self.grad_of(p)

    def clip_divisor(self, max_norm: float, norm: th.Tensor | None = None) -> th.Tensor | None:
        """
        :param max_norm: the largest allowed total 2-norm
        :param norm: the gradient's total 2-norm where it is not in the gradient buffer (default: that buffer's)
        :return: what to divide the gradient by to clip it as ``torch.nn.utils.clip_grad_norm_`` does: a 0-dim
            tensor, at least 1. On a GPU it is computed there (no host sync). On the CPU the norm is read on the host,
            where the rest is cheaper than four 0-dim kernels, and ``None`` comes back when the gradient needs no
            clipping.
        """
        if norm is None:
            norm = th.linalg.vector_norm(self.grad)
        if norm.device.type != "cpu":
            return norm.add_(1e-6).div_(max_norm).clamp_(min=1.0)
        divisor = (float(norm) + 1e-6) / max_norm
        if divisor <= 1.0:
            return None
        return self.divisor_tensor(divisor)

    def divisor_tensor(self, divisor: float) -> th.Tensor:
        """:return: ``divisor`` in a 0-dim CPU tensor of the gradient's dtype, kept from call to call"""
        if self._divisor is None:
            with th.inference_mode(False):
                self._divisor = th.empty((), dtype=self.grad.dtype)
        return self._divisor.fill_(divisor)
