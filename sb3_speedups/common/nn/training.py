"""
The training executor of an MLP description (:mod:`sb3_speedups.common.nn.mlp`): hand-derived forward and backward,
without autograd, on views of one flat parameter buffer, every intermediate in a kept buffer.

The per-update cost is then a few large matrix products plus a few dozen element-wise kernels. Equally shaped
networks (the policy and value networks of the default ``pi=[64, 64], vf=[64, 64]``) run as one batched product per
layer over their stacked views (:class:`MlpChain`); :mod:`sb3_speedups.common.nn.actor_critic_mlp` adds the heads of an
``ActorCriticPolicy``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch as th

from sb3_speedups.common.nn.mlp import NONE, Mlp, biases, stack
from sb3_speedups.common.nn.flat import FlatParameters

__all__ = ["InputNorm", "MlpChain"]


class InputNorm(Protocol):
    """
    A normalisation of a layer's input inside an :class:`MlpChain` (CrossQ's batch renormalisation), with its own kept
    state: the chain calls :meth:`backward` after :meth:`forward` on the same rows.
    """

    def forward(self, x: th.Tensor) -> th.Tensor:
        """:return: the normalised block of ``x`` (``[n, F]`` or ``[G, n, F]``, possibly an expanded view)"""
        ...

    def backward(self, grad: th.Tensor, input_grad: bool) -> th.Tensor | None:
        """Write the parameters' gradients given the output's gradient; :return: the input's (when ``input_grad``)"""
        ...

    def centred(self) -> th.Tensor | None:
        """:return: the last forward's centred input when :meth:`backward_linear` can run now, else ``None``"""
        ...

    def backward_linear(
        self, d: th.Tensor, weight: th.Tensor, grad_weight: th.Tensor, grad_bias: th.Tensor, grad_y: th.Tensor | None
    ) -> th.Tensor:
        """
        :meth:`backward` of a norm whose output feeds a layer (``weight``) with output gradient ``d``, taking its column
        sums from that layer's gradients: ``grad_weight`` holds ``d^T @ centred()`` and becomes the layer's weight
        gradient, ``grad_bias`` holds ``sum(d)``; ``grad_y`` is ``d @ weight`` (``None`` for a one-unit layer).
        :return: the input's gradient
        """
        ...


@dataclass
class _Workspace:
    """A chain's kept buffers for ``n`` rows, ``[G, n, width]`` per layer, with views made once."""

    acts: list[th.Tensor]
    #: gradients of the activations
    grads: list[th.Tensor]
    acts_t: list[th.Tensor]
    grads_t: list[th.Tensor]
    #: numpy views of ``acts``, where the activation runs in numpy
    arrays: list[np.ndarray] | None
    #: the matrices the products run on: ``acts``, ``grads``, ``acts_t``, ``grads_t`` as 2-D views when ``G == 1``
    #: (``mm`` is bit-equal to a one-batch ``bmm`` and faster for large layers on two threads), else themselves
    acts_m: list[th.Tensor]
    grads_m: list[th.Tensor]
    acts_t_m: list[th.Tensor]
    grads_t_m: list[th.Tensor]


@dataclass
class _Input:
    """The last input as the products take it and its transpose, made once (the same observations come back every epoch)."""

    x: th.Tensor
    #: ``x`` itself for one network or a one-hot input's columns, else expanded to ``[G, n, in]``
    h_m: th.Tensor
    #: the transpose of ``h_m``, made by the first backward that needs it
    h_t_m: th.Tensor | None = None

    def transposed(self) -> th.Tensor:
        """:return: :attr:`h_t_m`, made on the first call"""
        if self.h_t_m is None:
            self.h_t_m = self.h_m.mT
        return self.h_t_m


def _first(t: th.Tensor) -> th.Tensor:
    """:return: the only network's 2-D view of a ``[1, ...]`` tensor"""
    return t[0]


def _whole(t: th.Tensor) -> th.Tensor:
    """:return: ``t`` itself (several networks run as one batched product)"""
    return t


class MlpChain:
    """
    Forward and backward of ``G`` equally shaped MLPs (the pi/vf pair when stacked, else one) on ``[G, out, in]``
    views of a flat buffer.

    :param flat: the flat buffer holding the networks' parameters side by side
    :param mlps: the networks (:func:`~sb3_speedups.common.nn.mlp.parse_mlp` of the modules), every layer activated
        by one kind with a hand-derived backward (:meth:`~sb3_speedups.common.nn.mlp.Mlp.trainable_reason`); with a
        one-hot input (:attr:`~sb3_speedups.common.nn.mlp.Mlp.one_hot`) the input is its hot columns, and the first
        layer a gather
    :param norms: a normalisation (or ``None``) of each layer's input, then one of the last activations (the
        output), each taking the blocks the products take (``[n, F]`` for one network, else ``[G, n, F]``); the
        networks then back-propagate all the forward's rows (no :meth:`forward_tangent`)
    """

    def __init__(self, flat: FlatParameters, mlps: list[Mlp], norms: Sequence[InputNorm | None] | None = None) -> None:
        data = stack(mlps, flat.stacked)
        grads = stack(mlps, lambda tensors: flat.stacked(tensors, grad=True))
        activation = mlps[0].activation or NONE  # (no layers: none runs)
        if activation.torch_ is None or activation.numpy is None or activation.backward is None:
            raise ValueError(f"activation {activation.name} has no hand-derived backward")
        self.activation = activation
        self._torch_, self._numpy_, self._backward = activation.torch_, activation.numpy, activation.backward
        self.groups = len(mlps)
        self.weights = [layer.weight for layer in data.layers]
        self.weights_t = [w.transpose(1, 2) for w in self.weights]
        self.biases = [b.unsqueeze(1) for b in biases(data.layers)]
        self.grad_weights = [layer.weight for layer in grads.layers]
        self.grad_biases = biases(grads.layers)
        self.grad_weights_t = [g.transpose(1, 2) for g in self.grad_weights]
        if norms is not None and (len(norms) != len(self.weights) + 1 or mlps[0].one_hot is not None):
            raise ValueError("norms needs one entry per layer and one for the output, and float inputs")
        self.norms = None if norms is None else list(norms)
        #: what each layer's product took and the output, in the last forward with norms
        self._normed: list[th.Tensor] = []
        self._output = th.empty(0)
        # One network runs on 2-D views with mm/addmm; several on 3-D ones with bmm/baddbmm.
        single = self.groups == 1
        self._mat = _first if single else _whole
        self._mm: Callable[..., th.Tensor] = th.mm if single else th.bmm
        self._addmm: Callable[..., th.Tensor] = th.addmm if single else th.baddbmm
        self._row_dim = 0 if single else 1
        self.one_hot = mlps[0].one_hot
        # the first layer's product: a gather of the hot columns' weights for a one-hot input
        self._affines: list[Callable[..., th.Tensor]] = [self._addmm] * len(self.weights)
        if self.one_hot is not None and self._affines:
            self._affines[0] = self.one_hot.addmm
        self._weights_m = [self._mat(w) for w in self.weights]
        self._weights_t_m = [self._mat(w) for w in self.weights_t]
        self._biases_m = [self._mat(b) for b in self.biases]
        self._grad_weights_m = [self._mat(g) for g in self.grad_weights]
        self._grad_weights_t_m = [self._mat(g) for g in self.grad_weights_t]
        self._grad_biases_m = [self._mat(g) for g in self.grad_biases]
        self.ws: dict[int, _Workspace] = {}
        self._input: _Input | None = None
        # row-cut views of a workspace and its input, for backward passes over the first rows of a forward
        self._cuts: dict[tuple[int, int], tuple[_Workspace, _Input, th.Tensor, th.Tensor]] = {}

    @th.inference_mode(False)
    def _workspace(self, n: int, x: th.Tensor) -> _Workspace:
        # Allocated as normal tensors even when the update runs under inference mode, so they work in any mode.
        dtype = self.weights[0].dtype
        acts = [th.empty(self.groups, n, w.shape[1], dtype=dtype, device=x.device) for w in self.weights]
        grads = [th.empty(self.groups, n, w.shape[1], dtype=dtype, device=x.device) for w in self.weights]
        numpy = self.activation.numpy_on_cpu and x.device.type == "cpu"
        acts_t = [buffer.transpose(1, 2) for buffer in acts]
        grads_t = [buffer.transpose(1, 2) for buffer in grads]
        mat = self._mat
        self.ws[n] = _Workspace(
            acts,
            grads,
            acts_t,
            grads_t,
            [buffer.numpy() for buffer in acts] if numpy else None,
            [mat(t) for t in acts],
            [mat(t) for t in grads],
            [mat(t) for t in acts_t],
            [mat(t) for t in grads_t],
        )
        return self.ws[n]

    def last_grad(self, n: int) -> th.Tensor:
        """:return: the buffer for the gradient of the last activations ``[G, n, out]`` (after a forward of ``n``)"""
        return self.ws[n].grads[-1]

    def forward(self, x: th.Tensor) -> th.Tensor:
        """:return: the last activations ``[G, n, out]`` (``x`` expanded when there are no layers)"""
        n = x.shape[0]
        given = self._input
        if not self.weights:
            return x.expand(self.groups, n, x.shape[1])
        if given is None or given.x is not x:
            as_given = self._row_dim == 0 or self.one_hot is not None  # a gather of stacked weights gives [G, n, out]
            given = self._input = _Input(x, x if as_given else x.expand(self.groups, n, x.shape[1]))
        ws = self.ws.get(n) or self._workspace(n, x)
        h, arrays = given.h_m, ws.arrays
        if self.norms is not None:
            return self._forward_normed(h, ws)
        if arrays is None:
            for affine, w_t, b, out in zip(self._affines, self._weights_t_m, self._biases_m, ws.acts_m, strict=True):
                h = self._activate_(affine(b, h, w_t, out=out))
            return ws.acts[-1]
        numpy_ = self._numpy_
        layers = zip(self._affines, self._weights_t_m, self._biases_m, ws.acts_m, arrays, strict=True)
        for affine, w_t, b, out, array in layers:
            h = affine(b, h, w_t, out=out)
            numpy_(array)  # the activation on numpy views made once
        return ws.acts[-1]

    def _forward_normed(self, h: th.Tensor, ws: _Workspace) -> th.Tensor:
        """:meth:`forward` with :attr:`norms`, keeping what each layer's product took in :attr:`_normed`"""
        assert self.norms is not None
        normed = self._normed = []
        for k, (w_t, b, out) in enumerate(zip(self._weights_t_m, self._biases_m, ws.acts_m, strict=True)):
            norm = self.norms[k]
            h = h if norm is None else norm.forward(h)
            normed.append(h)
            h = self._activate_(self._addmm(b, h, w_t, out=out))
        last = self.norms[-1]
        normed.append(h if last is None else last.forward(h))
        self._output = normed[-1] if normed[-1].dim() == 3 else normed[-1].unsqueeze(0)
        return self._output

    def output(self, n: int) -> th.Tensor:
        """:return: what the last forward of ``n`` rows returned (``[G, n, out]``)"""
        return self._output if self.norms is not None else self.ws[n].acts[-1]

    def _backward_normed(self, d: th.Tensor, output_norm: bool) -> None:
        """
        :meth:`backward` with :attr:`norms`, over all the rows of the last forward (``d`` is the output's gradient, or
        without ``output_norm`` the gradient of the last activations before the output norm)
        """
        assert self.norms is not None
        ws, backward_, mm, normed = self.ws[d.shape[-2]], self._backward, self._mm, self._normed
        d = self._mat(d)
        last = self.norms[-1]
        if last is not None and output_norm:
            d = last.backward(d, True)  # type: ignore[assignment]
        for k in range(len(self.weights) - 1, -1, -1):
            backward_(d, ws.acts_m[k])
            gw = self._grad_weights_m[k]
            norm = self.norms[k]
            # a norm between two layers takes its column sums from this layer's gradients (fewer passes over the block)
            centred = norm.centred() if k > 0 and norm is not None and gw.shape[-1] >= gw.shape[-2] else None
            if centred is not None:
                assert norm is not None
                mm(d.mT, centred, out=gw)
                th.sum(d, self._row_dim, out=self._grad_biases_m[k])
                d_y = mm(d, self._weights_m[k], out=ws.grads_m[k - 1])
                d = norm.backward_linear(d, self._weights_m[k], gw, self._grad_biases_m[k], d_y)
                continue
            if gw.shape[-1] < gw.shape[-2]:  # as in backward: the transposed product of a narrow input
                self._grad_weights_t_m[k].copy_(mm(normed[k].mT, d))
            else:
                mm(d.mT, normed[k], out=gw)
            th.sum(d, self._row_dim, out=self._grad_biases_m[k])
            if k > 0:
                d = mm(d, self._weights_m[k], out=ws.grads_m[k - 1])
                d = d if norm is None else norm.backward(d, True)  # type: ignore[assignment]
            elif norm is not None:  # (its transpose: a product to a narrow input is a poor GEMM shape)
                norm.backward(mm(self._weights_t_m[0], d.mT).mT, False)

    def _activate_(self, x: th.Tensor) -> th.Tensor:
        """Apply the activation in place: numpy's kernel on contiguous CPU tensors where it is the faster one."""
        if self.activation.numpy_on_cpu and x.device.type == "cpu" and x.is_contiguous():
            self._numpy_(x.numpy())
            return x
        return self._torch_(x)

    def backward(self, d_last: th.Tensor, n: int | None = None, output_norm: bool = True) -> None:
        """
        Write the weight and bias gradients, given the gradient of the last activations (overwritten).

        :param d_last: ``[G, rows, out]``, for the first ``rows`` rows of the last forward
        :param n: the row count of that forward, when it ran more rows than ``d_last`` has (an off-policy actor runs
            the observations and the next observations in one forward and back-propagates the first half only)
        :param output_norm: ``d_last`` is the gradient of the output norm's output; ``False``: of its input (the
            caller ran that norm's backward)
        """
        if self.norms is not None:
            if n is not None and n != d_last.shape[1]:
                raise ValueError("a chain with norms back-propagates all the rows of its forward")
            self._backward_normed(d_last, output_norm)
            return
        ws, h, h_t = self._rows(d_last, n)
        backward_, mm = self._backward, self._mm
        if d_last is ws.grads[-1]:
            d, d_t = ws.grads_m[-1], ws.grads_t_m[-1]
        else:
            d = self._mat(d_last)
            d_t = d.mT
        for k in range(len(self.weights) - 1, -1, -1):
            backward_(d, ws.acts_m[k])
            gw = self._grad_weights_m[k]
            if k == 0 and self.one_hot is not None:
                self.one_hot.weight_grad(self._grad_weights_t_m[0], h, d)
            elif gw.shape[-1] < gw.shape[-2]:
                # [out, n] @ [n, in] with a narrow `in` is a poor GEMM shape; its transpose is not.
                below_t = ws.acts_t_m[k - 1] if k > 0 else h_t
                self._grad_weights_t_m[k].copy_(mm(below_t, d))
            else:
                mm(d_t, ws.acts_m[k - 1] if k > 0 else h, out=gw)
            th.sum(d, self._row_dim, out=self._grad_biases_m[k])
            if k > 0:
                d = mm(d, self._weights_m[k], out=ws.grads_m[k - 1])
                d_t = ws.grads_t_m[k - 1]

    def _rows(self, d_last: th.Tensor, n: int | None) -> tuple[_Workspace, th.Tensor, th.Tensor]:
        """:return: the workspace of the last forward and its input (as the products take it), cut to ``d_last``'s rows"""
        rows = d_last.shape[1]
        ws, given = self.ws[rows if n is None else n], self._input
        assert given is not None, "backward before forward"
        if n is None or n == rows:
            return ws, given.h_m, given.transposed()
        cut = self._cuts.get((n, rows))
        if cut is None or cut[1] is not given:
            acts, grads = [a[:, :rows] for a in ws.acts], [g[:, :rows] for g in ws.grads]
            acts_t, grads_t = [a[:, :, :rows] for a in ws.acts_t], [g[:, :, :rows] for g in ws.grads_t]
            mat = self._mat
            part = _Workspace(
                acts,
                grads,
                acts_t,
                grads_t,
                None,
                [mat(t) for t in acts],
                [mat(t) for t in grads],
                [mat(t) for t in acts_t],
                [mat(t) for t in grads_t],
            )
            h_m, h_t_m = given.h_m.narrow(-2, 0, rows), given.transposed().narrow(-1, 0, rows)
            cut = self._cuts[(n, rows)] = (part, given, h_m, h_t_m)
        return cut[0], cut[2], cut[3]

    def backward_input(self, d_last: th.Tensor, columns: slice) -> th.Tensor:
        """
        Back-propagate to the input only (no weight gradients): what a loss that trains another network through
        this one needs (an off-policy actor's loss through the critics).

        :param d_last: gradient of the last activations (the output, with norms) ``[G, n, out]`` of the last forward
            (overwritten)
        :param columns: the input columns whose gradient is wanted
        :return: the gradient of those input columns ``[G, n, len(columns)]`` (a new tensor)
        """
        if self.one_hot is not None:
            raise ValueError("a one-hot input has no gradient")
        ws, backward_, mm = self.ws[d_last.shape[1]], self._backward, self._mm
        norms = self.norms or [None] * (len(self.weights) + 1)
        d = ws.grads_m[-1] if d_last is ws.grads[-1] else self._mat(d_last)
        if norms[-1] is not None:
            d = norms[-1].backward(d, True)  # type: ignore[assignment]
        for k in range(len(self.weights) - 1, 0, -1):
            backward_(d, ws.acts_m[k])
            d = mm(d, self._weights_m[k], out=ws.grads_m[k - 1])
            if norms[k] is not None:
                d = norms[k].backward(d, True)  # type: ignore[assignment,union-attr]
        backward_(d, ws.acts_m[0])
        first = norms[0]
        if first is None:
            d_input = mm(d, self._weights_m[0][..., columns])
        else:
            d_input = first.backward(mm(self._weights_t_m[0], d.mT).mT, True)[..., columns]  # type: ignore[index]
        return d_input.unsqueeze(0) if d_input.dim() == 2 else d_input

    def forward_tangent(self, n: int) -> th.Tensor | None:
        """
        Forward-mode derivative of the last forward of ``n`` rows along the parameter direction held in the gradient
        buffer's views (TRPO's Fisher-vector product; ``docs/maths.md``, "TRPO Fisher-vector product"):
        ``t_k = act'(z_k) * (dW_k h_{k-1} + db_k + W_k t_{k-1})``, with ``t_0``'s ``W_0 t_{-1}`` term absent.

        :param n: the row count of the last forward (its kept activations are the linearisation point)
        :return: the tangent of the last activations ``[G, n, out]``, written into the buffer :meth:`backward` takes
            (:meth:`last_grad`), or ``None`` without layers (the input has no tangent)
        """
        if not self.weights:
            return None
        if self.norms is not None:
            raise ValueError("a chain with norms has no tangent")
        ws, given = self.ws[n], self._input
        assert given is not None, "tangent before forward"
        h = given.h_m
        for k, affine in enumerate(self._affines):
            t = affine(self._grad_biases_m[k].unsqueeze(-2), h, self._grad_weights_t_m[k], out=ws.grads_m[k])
            if k > 0:
                t.add_(self._mm(ws.grads_m[k - 1], self._weights_t_m[k]))
            self._backward(t, ws.acts_m[k])
            h = ws.acts_m[k]
        return ws.grads[-1]

    @th.no_grad()
    def forward_one(self, x: th.Tensor, g: int) -> th.Tensor:
        """:return: the last activations of network ``g`` for ``x`` ``[n, in]`` (allocates; not for hot paths)"""
        h = x
        for k, (w, b) in enumerate(zip(self.weights, self.biases, strict=True)):
            affine = self.one_hot.addmm if k == 0 and self.one_hot is not None else th.addmm
            h = self._activate_(affine(b[g, 0], h, w[g].t()))
        return h
