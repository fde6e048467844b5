"""
The training executor of an MLP description (:mod:`sb3_speedups.common.nn.mlp`): hand-derived forward and backward,
without autograd, on views of one flat parameter buffer, every intermediate in a kept buffer.

The per-update cost is then a few large matrix products plus a few dozen element-wise kernels. Equally shaped
networks (the policy and value networks of the default ``pi=[64, 64], vf=[64, 64]``) run as one batched product per
layer over their stacked views (:class:`MlpChain`); :class:`ActorCriticMlp` adds the heads of an ``ActorCriticPolicy``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy

from sb3_speedups.common.nn.actor_critic import (
    critic_parameters,
    flat_layout,
    mlp_unsupported_reason,
    parse_actor_critic,
    split_layout,
)
from sb3_speedups.common.nn.mlp import NONE, Mlp, biases, stack
from sb3_speedups.common.nn.flat import FlatParameters

__all__ = ["ActorCriticMlp", "MlpChain", "mlp_unsupported_reason"]


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
    """The last input, expanded to ``[G, n, in]``, and its transpose (the same observations come back every epoch)."""

    x: th.Tensor
    h: th.Tensor
    h_t: th.Tensor
    #: ``h`` and ``h_t`` as the products take them (2-D when ``G == 1``)
    h_m: th.Tensor
    h_t_m: th.Tensor


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
        by one kind with a hand-derived backward (:meth:`~sb3_speedups.common.nn.mlp.Mlp.trainable_reason`)
    """

    def __init__(self, flat: FlatParameters, mlps: list[Mlp]) -> None:
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
        # One network runs on 2-D views with mm/addmm; several on 3-D ones with bmm/baddbmm.
        single = self.groups == 1
        self._mat = _first if single else _whole
        self._mm: Callable[..., th.Tensor] = th.mm if single else th.bmm
        self._addmm: Callable[..., th.Tensor] = th.addmm if single else th.baddbmm
        self._row_dim = 0 if single else 1
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
        acts = [th.empty(self.groups, n, w.shape[1], device=x.device) for w in self.weights]
        grads = [th.empty(self.groups, n, w.shape[1], device=x.device) for w in self.weights]
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
        if given is None or given.x is not x:
            h = x.expand(self.groups, n, x.shape[1])
            h_t = h.transpose(1, 2)
            given = self._input = _Input(x, h, h_t, self._mat(h), self._mat(h_t))
        if not self.weights:
            return given.h
        ws = self.ws.get(n) or self._workspace(n, x)
        h, addmm, arrays = given.h_m, self._addmm, ws.arrays
        if arrays is None:
            for w_t, b, out in zip(self._weights_t_m, self._biases_m, ws.acts_m, strict=True):
                h = self._activate_(addmm(b, h, w_t, out=out))
            return ws.acts[-1]
        numpy_ = self._numpy_
        for w_t, b, out, array in zip(self._weights_t_m, self._biases_m, ws.acts_m, arrays, strict=True):
            h = addmm(b, h, w_t, out=out)
            numpy_(array)  # the activation on numpy views made once
        return ws.acts[-1]

    def _activate_(self, x: th.Tensor) -> th.Tensor:
        """Apply the activation in place: numpy's kernel on contiguous CPU tensors where it is the faster one."""
        if self.activation.numpy_on_cpu and x.device.type == "cpu" and x.is_contiguous():
            self._numpy_(x.numpy())
            return x
        return self._torch_(x)

    def backward(self, d_last: th.Tensor, n: int | None = None) -> None:
        """
        Write the weight and bias gradients, given the gradient of the last activations (overwritten).

        :param d_last: ``[G, rows, out]``, for the first ``rows`` rows of the last forward
        :param n: the row count of that forward, when it ran more rows than ``d_last`` has (an off-policy actor runs
            the observations and the next observations in one forward and back-propagates the first half only)
        """
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
            if gw.shape[-1] < gw.shape[-2]:
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
            return ws, given.h_m, given.h_t_m
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
            cut = self._cuts[(n, rows)] = (part, given, mat(given.h[:, :rows]), mat(given.h_t[:, :, :rows]))
        return cut[0], cut[2], cut[3]

    def backward_input(self, d_last: th.Tensor, columns: slice) -> th.Tensor:
        """
        Back-propagate to the input only (no weight gradients): what a loss that trains another network through
        this one needs (an off-policy actor's loss through the critics).

        :param d_last: gradient of the last activations ``[G, n, out]`` of the last forward (overwritten)
        :param columns: the input columns whose gradient is wanted
        :return: the gradient of those input columns ``[G, n, len(columns)]`` (a new tensor)
        """
        ws, backward_, mm = self.ws[d_last.shape[1]], self._backward, self._mm
        d = ws.grads_m[-1] if d_last is ws.grads[-1] else self._mat(d_last)
        for k in range(len(self.weights) - 1, 0, -1):
            backward_(d, ws.acts_m[k])
            d = mm(d, self._weights_m[k], out=ws.grads_m[k - 1])
        backward_(d, ws.acts_m[0])
        d_input = mm(d, self._weights_m[0][..., columns])
        return d_input.unsqueeze(0) if self.groups == 1 else d_input

    @th.no_grad()
    def forward_one(self, x: th.Tensor, g: int) -> th.Tensor:
        """:return: the last activations of network ``g`` for ``x`` ``[n, in]`` (allocates; not for hot paths)"""
        h = x
        for w, b in zip(self.weights, self.biases, strict=True):
            h = self._activate_(th.addmm(b[g, 0], h, w[g].t()))
        return h


@dataclass
class _Outputs:
    """The heads' kept outputs for ``n`` rows."""

    out: th.Tensor
    values: th.Tensor
    #: gradient of ``out``, filled by the action head
    d_out: th.Tensor
    values_flat: th.Tensor


@dataclass
class _PartViews:
    """A part's latent and numpy views of it and of its head's output, made once per chain output."""

    source: th.Tensor
    latent: th.Tensor
    arrays: tuple[np.ndarray, np.ndarray] | None


@dataclass
class _GradViews:
    """Views of the gradient of a part's head output, made once per buffer."""

    d: th.Tensor
    d_t: th.Tensor
    #: the chain's buffer for the gradient of its last activations, and this part's row of it
    d_last: th.Tensor | None
    d_last_part: th.Tensor | None


class ActorCriticMlp:
    """
    Forward and backward of a supported ``ActorCriticPolicy`` (check :func:`mlp_unsupported_reason`) on views of
    one flat parameter buffer. Building it moves the policy's parameters into :attr:`flat`. Part 0 is the actor
    (policy network and action net), part 1 the critic (value network and value net).

    :param policy: the policy; its parameters stay its own ``nn.Parameter`` objects
    :param split: run the actor and the critic as two separate parts (:meth:`forward_part`, :meth:`backward_part`)
        that two processes can compute side by side: nothing stacked, and the flat buffers (in shared memory) laid
        out as :func:`~sb3_speedups.common.nn.actor_critic.split_layout`, the critic from :attr:`critic_start` on
    """

    def __init__(self, policy: ActorCriticPolicy, split: bool = False) -> None:
        reason = mlp_unsupported_reason(policy)
        ac = parse_actor_critic(policy)
        heads = None if isinstance(ac, str) else ac.heads()
        if reason is not None or isinstance(ac, str) or heads is None:
            raise ValueError(reason or "not an MLP actor-critic")
        self.stacked = ac.pi.same_shapes(ac.vf) and not split
        layout = split_layout(ac, policy) if split else flat_layout(ac, policy)
        critic = critic_parameters(ac)
        self.flat = FlatParameters(list(policy.parameters()), layout, shared=split, aligned=critic[0] if split else None)
        self.critic_start = self.flat.offset(critic[0]) if split else self.flat.data.numel()
        self.chains = (
            [MlpChain(self.flat, [ac.pi, ac.vf])]
            if self.stacked
            else [MlpChain(self.flat, [ac.pi]), MlpChain(self.flat, [ac.vf])]
        )
        # per part: the head's weight [n_out, width], its transpose, bias, and the gradients of weight and bias
        self.head_weights = [self.flat.data_of(head.weight) for head in heads]
        self.head_weights_t = [w.t() for w in self.head_weights]
        self.head_biases = [self.flat.data_of(b) for b in biases(heads)]
        self.grad_head_weights = [self.flat.grad_of(head.weight) for head in heads]
        self.grad_head_biases = [self.flat.grad_of(b) for b in biases(heads)]
        self.log_std = None if ac.log_std is None else self.flat.data_of(ac.log_std)
        self.grad_log_std = None if ac.log_std is None else self.flat.grad_of(ac.log_std)
        # On the CPU the heads' products run in numpy (lower per-call overhead than torch's addmm at these sizes).
        self._numpy_heads = (
            [(w.numpy().T, b.numpy()) for w, b in zip(self.head_weights, self.head_biases, strict=True)]
            if self.flat.data.device.type == "cpu"
            else None
        )
        self._out: dict[int, _Outputs] = {}
        self._views: dict[tuple[int, int], _PartViews] = {}
        self._grads: list[_GradViews | None] = [None, None]
        self.latents: list[th.Tensor | None] = [None, None]  # kept from the forward for the backward

    @th.inference_mode(False)
    def _allocate_out(self, n: int, device: th.device) -> _Outputs:
        n_out = self.head_weights[0].shape[0]
        values = th.empty(n, 1, device=device)
        self._out[n] = _Outputs(th.empty(n, n_out, device=device), values, th.empty(n, n_out, device=device), values.view(-1))
        return self._out[n]

    def d_out_buffer(self, n: int) -> th.Tensor:
        """:return: a buffer for the gradient of the action net's output (filled by the action head)"""
        return self._out[n].d_out

    def _part_views(self, part: int, source: th.Tensor, outputs: _Outputs) -> _PartViews:
        n = source.shape[1]
        views = self._views.get((part, n))
        if views is None or views.source is not source:
            latent = source[part] if self.stacked else source[0]
            dst = outputs.out if part == 0 else outputs.values
            arrays = (latent.numpy(), dst.numpy()) if self._numpy_heads is not None and latent.is_contiguous() else None
            views = self._views[(part, n)] = _PartViews(source, latent, arrays)
        self.latents[part] = views.latent
        return views

    def _head(self, part: int, views: _PartViews, outputs: _Outputs, numpy: bool) -> None:
        arrays, heads = views.arrays, self._numpy_heads
        if numpy and arrays is not None and heads is not None:
            (latent, result), (weight_t, bias) = arrays, heads[part]
            np.add(np.matmul(latent, weight_t, out=result), bias, out=result)
        else:
            dst = outputs.out if part == 0 else outputs.values
            th.addmm(self.head_biases[part], views.latent, self.head_weights_t[part], out=dst)

    def forward_part(self, x: th.Tensor, part: int) -> th.Tensor:
        """
        The forward of one part of a ``split`` network (the same operations as :meth:`forward` runs for it).

        :param x: flat float observations ``[n, obs_dim]``
        :param part: 0 for the actor, 1 for the critic
        :return: the action net's output ``[n, n_actions_out]`` (actor) or the values ``[n]`` (critic), reused buffers
        """
        outputs = self._out.get(x.shape[0]) or self._allocate_out(x.shape[0], x.device)
        views = self._part_views(part, self.chains[part].forward(x), outputs)
        self._head(part, views, outputs, views.arrays is not None)
        return outputs.out if part == 0 else outputs.values_flat

    def forward(self, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """
        :param x: flat float observations ``[n, obs_dim]``
        :return: the action net's output ``[n, n_actions_out]`` and the values ``[n]`` (reused buffers)
        """
        outputs = self._out.get(x.shape[0]) or self._allocate_out(x.shape[0], x.device)
        pi_source = self.chains[0].forward(x)
        vf_source = pi_source if self.stacked else self.chains[1].forward(x)
        pi_views = self._part_views(0, pi_source, outputs)
        vf_views = self._part_views(1, vf_source, outputs)
        numpy = pi_views.arrays is not None and vf_views.arrays is not None
        self._head(0, pi_views, outputs, numpy)
        self._head(1, vf_views, outputs, numpy)
        return outputs.out, outputs.values_flat

    def _grad_views(self, d: th.Tensor, part: int) -> _GradViews:
        views = self._grads[part]
        if views is None or views.d is not d:
            chain = self.chains[0 if self.stacked else part]
            d_last = chain.last_grad(d.shape[0]) if chain.weights else None
            row = part if self.stacked else 0
            views = self._grads[part] = _GradViews(d, d.t(), d_last, None if d_last is None else d_last[row])
        return views

    def _backward_head(self, d: th.Tensor, part: int) -> _GradViews:
        """Write the head's gradients and the gradient of the part's latent; :return: the views used"""
        views, latent = self._grad_views(d, part), self.latents[part]
        assert latent is not None, "backward before forward"
        th.mm(views.d_t, latent, out=self.grad_head_weights[part])
        th.sum(d, 0, out=self.grad_head_biases[part])
        if views.d_last_part is not None:
            th.mm(d, self.head_weights[part], out=views.d_last_part)
        return views

    def backward_part(self, d: th.Tensor, part: int) -> None:
        """
        Write the gradients of one part of a ``split`` network (all but ``log_std``) into :attr:`flat` ``.grad``.

        :param d: gradient of the action net's output ``[n, n_out]`` (actor) or of the values ``[n, 1]`` (critic)
        :param part: 0 for the actor, 1 for the critic
        """
        views = self._backward_head(d, part)
        if views.d_last is not None:
            self.chains[part].backward(views.d_last)

    def backward(self, d_out: th.Tensor, d_values: th.Tensor) -> None:
        """
        Write the gradients of all parameters but ``log_std`` into :attr:`flat` ``.grad``.

        :param d_out: gradient of the action net's output ``[n, n_out]``
        :param d_values: gradient of the values ``[n, 1]``
        """
        if not self.stacked:
            self.backward_part(d_out, 0)
            self.backward_part(d_values, 1)
            return
        self._backward_head(d_out, 0)
        views = self._backward_head(d_values, 1)
        if views.d_last is not None:
            self.chains[0].backward(views.d_last)

    @th.no_grad()
    def predict_values(self, x: th.Tensor) -> th.Tensor:
        """:return: values ``[n]`` of any number of observations (allocates; not for the per-minibatch path)"""
        latent = self.chains[0].forward_one(x, 1) if self.stacked else self.chains[1].forward_one(x, 0)
        return th.addmm(self.head_biases[1], latent, self.head_weights[1].t()).view(-1)
