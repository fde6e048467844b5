"""
The MLP of an off-policy actor (SAC's ``Actor``, TD3's and DDPG's): hidden layers (one
:class:`~sb3_speedups.common.nn.training.MlpChain`) and one linear output layer, on views of a flat buffer, with
hand-derived forward and backward and a fused Adam. What the output means (a squashed Gaussian's mean and log std, a
deterministic action before its tanh) is the algorithm's: it gives the gradient of the output.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch as th
from torch import nn

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.mlp import Mlp
from sb3_speedups.common.nn.optim import FlatAdam
from sb3_speedups.common.nn.training import InputNorm, MlpChain


class ActorNet:
    """
    :param module: the actor; its ``parameters()`` are what the optimizer holds, in that order
    :param hidden: its hidden layers (activated, with biases)
    :param head_weights: the output layers' weights, stacked as the output's rows in this order (SAC: ``mu`` and
        ``log_std``, so one product gives both)
    :param head_biases: their biases, in the same order
    :param optimizer: the actor's Adam, or ``None`` for a target copy (forward only)
    :param norms: makes the hidden layers' input norms from the flat buffer (:class:`MlpChain`'s ``norms``; CrossQ's
        batch renormalisation)
    """

    def __init__(
        self,
        module: nn.Module,
        hidden: Mlp,
        head_weights: list[th.Tensor],
        head_biases: list[th.Tensor],
        optimizer: th.optim.Optimizer | None,
        norms: Callable[[FlatParameters], Sequence[InputNorm | None]] | None = None,
    ) -> None:
        # the module's order (the frozen acting copy's: products of equally aligned operands round alike), but the
        # heads' weights side by side, then their biases, where the first of them is
        heads = [*head_weights, *head_biases]
        in_heads = {id(t) for t in heads}
        layout: list[th.Tensor] = []
        placed = False
        for p in module.parameters():
            if id(p) not in in_heads:
                layout.append(p)
            elif not placed:
                layout += heads
                placed = True
        self.flat = FlatParameters(list(module.parameters()), layout)
        self.adam = None if optimizer is None else FlatAdam(self.flat, optimizer)
        self.chain = MlpChain(self.flat, [hidden], None if norms is None else norms(self.flat))
        width = head_weights[0].shape[1]
        self.weight = self.flat.stacked(head_weights).view(-1, width)
        self.weight_t = self.weight.t()
        self.bias = self.flat.stacked(head_biases).view(-1)
        self.grad_weight = self.flat.stacked(head_weights, grad=True).view(-1, width)
        self.grad_bias = self.flat.stacked(head_biases, grad=True).view(-1)
        self._out: dict[int, th.Tensor] = {}
        self._d_latent: dict[tuple[int, int], th.Tensor] = {}
        self._n = 0

    def is_bound(self) -> bool:
        """:return: whether the parameters (and the optimizer state) still live in the flat buffers"""
        return self.flat.is_bound() and (self.adam is None or self.adam.is_bound())

    def forward(self, x: th.Tensor) -> th.Tensor:
        """:return: the output ``[n, k]`` of inputs ``[n, obs_dim]`` (a buffer the next forward of ``n`` rows reuses)"""
        n = x.shape[0]
        out = self._out.get(n)
        if out is None:
            with th.inference_mode(False):
                out = self._out[n] = th.empty(n, self.weight.shape[0], device=x.device)
        self._n = n
        return th.addmm(self.bias, self.chain.forward(x)[0], self.weight_t, out=out)

    def backward(self, d_out: th.Tensor) -> None:
        """
        Write the gradients of the parameters into the flat gradient buffer.

        :param d_out: the loss's gradient with respect to the first ``rows`` rows of the last forward's output
        """
        rows, n = d_out.shape[0], self._n
        latent = self.chain.output(n)[0, :rows]
        th.mm(d_out.t(), latent, out=self.grad_weight)
        th.sum(d_out, 0, out=self.grad_bias)
        d_latent = self._d_latent.get((n, rows))
        if d_latent is None:
            d_latent = self._d_latent[(n, rows)] = self.chain.last_grad(n)[:, :rows]
        th.mm(d_out, self.weight, out=d_latent[0])
        self.chain.backward(d_latent, n)

    def step(self, d_out: th.Tensor) -> None:
        """Back-propagate ``d_out`` (as :meth:`backward`) and take one Adam step."""
        assert self.adam is not None, "a target copy has no optimizer"
        self.backward(d_out)
        self.adam.step()
