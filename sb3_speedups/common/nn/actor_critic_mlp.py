"""
The training executor of an ``ActorCriticPolicy``'s MLPs and heads: :class:`ActorCriticMlp` runs the policy and value
networks through :class:`~sb3_speedups.common.nn.training.MlpChain` (stacked when equally shaped, else one chain each,
or two parts that two processes compute side by side) and adds the action and value heads, on views of one flat
parameter buffer.
"""

from __future__ import annotations

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
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.mlp import biases
from sb3_speedups.common.nn.training import MlpChain

__all__ = ["ActorCriticMlp"]


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
    :param shared: put the flat buffers in shared memory (default: ``split``); TRPO splits the parts to update them
        apart, in one process and on any device
    """

    def __init__(self, policy: ActorCriticPolicy, split: bool = False, shared: bool | None = None) -> None:
        reason = mlp_unsupported_reason(policy)
        ac = parse_actor_critic(policy)
        heads = None if isinstance(ac, str) else ac.heads()
        if reason is not None or isinstance(ac, str) or heads is None:
            raise ValueError(reason or "not an MLP actor-critic")
        self.stacked = ac.pi.same_shapes(ac.vf) and not split
        #: the networks' input of observations: float rows, or the hot columns of a one-hot input
        self.inputs = ac.pi.inputs
        layout = split_layout(ac, policy) if split else flat_layout(ac, policy)
        critic = critic_parameters(ac)
        shared = split if shared is None else shared
        self.flat = FlatParameters(list(policy.parameters()), layout, shared=shared, aligned=critic[0] if split else None)
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

        :param x: the networks' input (:attr:`inputs` of the observations)
        :param part: 0 for the actor, 1 for the critic
        :return: the action net's output ``[n, n_actions_out]`` (actor) or the values ``[n]`` (critic), reused buffers
        """
        outputs = self._out.get(x.shape[0]) or self._allocate_out(x.shape[0], x.device)
        views = self._part_views(part, self.chains[part].forward(x), outputs)
        self._head(part, views, outputs, views.arrays is not None)
        return outputs.out if part == 0 else outputs.values_flat

    def forward(self, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """
        :param x: the networks' input (:attr:`inputs` of the observations)
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
