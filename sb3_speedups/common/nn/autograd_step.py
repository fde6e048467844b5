"""
The optimizer step of an autograd loss on flat buffers (:class:`FlatOptimizerStep`): PPO's, A2C's, DQN's, SAC's,
TD3's and CrossQ's autograd updates and RecurrentPPO's.
"""

from __future__ import annotations

import torch as th
from torch import nn

from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.optim import (
    FlatAdam,
    FlatRMSprop,
    adam_unsupported_reason,
    flat_optimizer_unsupported_reason,
    make_flat_optimizer,
)


class FlatOptimizerStep:
    """
    ``zero_grad`` / ``backward`` / ``clip_grad_norm_`` / ``optimizer.step`` for an autograd loss, with one flat
    gradient buffer and one fused Adam step when the optimizer is a plain ``torch.optim.Adam`` (otherwise the stock
    calls). Autograd accumulates straight into the flat gradient buffer (``param.grad`` are views of it), or with
    ``take_grads`` stores fresh gradient tensors that Adam steps with.

    :param module: the module whose parameters the optimizer holds
    :param optimizer: its optimizer (its ``param_groups`` stay the source of the learning rate)
    :param rmsprop: also run a plain ``torch.optim.RMSprop`` flat (:class:`FlatRMSprop`); off, it takes the stock
        calls, whose numbers differ from the flat step's in the last bits
    :param flat: ``False`` always takes the stock calls (where another flat buffer holds some of the parameters)
    :param take_grads: with a flat Adam, let autograd store each gradient as it computes it (``param.grad`` set to
        ``None`` before ``backward``, as ``zero_grad`` does) and step Adam over those tensors, instead of zeroing the
        flat gradient buffer and adding every gradient into it: two passes fewer over the gradient, which pays for
        networks with large layers (a CNN's first fully connected layer). The clipping norm is then stock's per-tensor
        norm of norms.
    """

    def __init__(
        self,
        module: nn.Module,
        optimizer: th.optim.Optimizer,
        rmsprop: bool = False,
        *,
        flat: bool = True,
        take_grads: bool = False,
    ) -> None:
        self.module, self.optimizer = module, optimizer
        params = list(module.parameters())
        self.flat: FlatParameters | None = None
        self.flat_optimizer: FlatAdam | FlatRMSprop | None = None
        self.take_grads = False
        unsupported = flat_optimizer_unsupported_reason if rmsprop else adam_unsupported_reason
        if flat and unsupported(optimizer, params) is None:
            self.flat = FlatParameters(params)
            self.flat_optimizer = make_flat_optimizer(self.flat, optimizer)
            self.take_grads = take_grads and isinstance(self.flat_optimizer, FlatAdam)
            if not self.take_grads:
                self._attach()

    @property
    def adam(self) -> FlatAdam | None:
        """:return: the flat Adam, where the optimizer is one"""
        return self.flat_optimizer if isinstance(self.flat_optimizer, FlatAdam) else None

    def _attach(self) -> None:
        assert self.flat is not None
        self.flat.attach_grads()
        self._views = [p.grad for p in self.flat.params]

    def is_bound(self, optimizer: th.optim.Optimizer) -> bool:
        """:return: whether ``optimizer`` is still ours and the parameters and its state still live in our buffers"""
        if optimizer is not self.optimizer:
            return False
        flat_optimizer = self.flat_optimizer
        return self.flat is None or (self.flat.is_bound() and flat_optimizer is not None and flat_optimizer.is_bound())

    def backward(self, loss: th.Tensor) -> None:
        """Back-propagate ``loss`` into zeroed gradients."""
        if self.flat is None:
            self.optimizer.zero_grad()
            loss.backward()
            return
        if self.take_grads:
            for p in self.flat.params:
                p.grad = None
            loss.backward()
            return
        self.flat.grad.zero_()
        loss.backward()
        if any(p.grad is not g for p, g in zip(self.flat.params, self._views, strict=True)):
            # the gradients were set to None or replaced (``optimizer.zero_grad()``): take them over and re-attach
            for p in self.flat.params:
                if p.grad is not None:
                    self.flat.grad_of(p).copy_(p.grad)
            self._attach()

    def step(self, max_grad_norm: float | None = None) -> None:
        """Clip the gradient's norm to ``max_grad_norm`` (``None``: no clipping) and take one optimizer step."""
        if self.flat is None or self.flat_optimizer is None:
            if max_grad_norm is not None:
                th.nn.utils.clip_grad_norm_(self.module.parameters(), max_grad_norm)
            self.optimizer.step()
            return
        if self.take_grads:
            assert isinstance(self.flat_optimizer, FlatAdam)
            # a parameter the loss does not reach steps with a zero gradient, as on the flat buffer
            grads = [th.zeros_like(p) if p.grad is None else p.grad for p in self.flat.params]
            divisor = None
            if max_grad_norm is not None:
                norm = th.linalg.vector_norm(th.stack(th._foreach_norm(grads)))
                divisor = self.flat.clip_divisor(max_grad_norm, norm)
            self.flat_optimizer.step(divisor, grads=grads)
            return
        self.flat_optimizer.step(None if max_grad_norm is None else self.flat.clip_divisor(max_grad_norm))
