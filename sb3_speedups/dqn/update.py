"""
One DQN gradient step (Huber loss on Q(s, a) against a given target, gradient clipping, Adam), two ways:

- :class:`HandDerivedQUpdate`: for an MLP ``QNetwork`` (flat ``Box``, ``Discrete``, ``MultiDiscrete`` or
  ``MultiBinary`` observations, ``Linear`` layers with ReLU or Tanh, stock Adam): hand-derived forward and backward
  into preallocated buffers, flat parameters and one fused Adam kernel (:mod:`sb3_speedups.common.nn.optim`),
  clipping without a host sync;
- :class:`AutogradQUpdate`: any other Q-network (dueling heads, CNN, ``Dict`` observations, custom optimizer),
  with autograd and the policy's own optimizer, as stock SB3 does.

What the network outputs and its loss are a :class:`QHead`'s: DQN's :class:`QValueHead` (one Q-value per action, the
Huber TD loss), or QR-DQN's quantiles (:class:`sb3_speedups.qrdqn.head.QuantileHead`). Both updates return the head's
per-step result (DQN: the TD errors ``Q(s, a) - target``, for prioritised replay and for the logged loss:
:func:`huber_` of all of one ``train()`` call's errors at once, with no ``.item()`` per step). ``weights`` are
importance-sampling weights (``None``: all 1, stock's loss).
The loss, its gradient and the tests that check them: see docs/maths.md, "DQN Huber TD loss".
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch as th
import torch.nn.functional as F
from stable_baselines3.common.policies import BasePolicy
from stable_baselines3.dqn.policies import QNetwork
from torch import nn

from sb3_speedups.common.nn.inputs import flat_extractor_unsupported_reason, flat_input_unsupported_reason
from sb3_speedups.common.nn.mlp import Mlp, parse_output_mlp
from sb3_speedups.common.nn.training import MlpChain
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep
from sb3_speedups.common.nn.optim import FlatAdam, adam_unsupported_reason
from sb3_speedups.common.torch_utils import has_convolutions, to_channels_last, trains_channels_last


def q_mlp(q_net: BasePolicy, head: QHead | None = None) -> Mlp | str:
    """
    :param head: what the network outputs (default: DQN's Q-values)
    :return: the description of the network's MLP (``q_net.q_net``) taking the observations as SB3 preprocesses them
        (the executors' input: :meth:`~sb3_speedups.common.nn.mlp.Mlp.inputs`), or why the hand-derived update cannot
        run it
    """
    mlp = parse_output_mlp((head or Q_VALUES).body(q_net))
    if isinstance(mlp, str):
        return mlp
    mlp = mlp.observing(q_net.observation_space)
    return mlp.head()[0].trainable_reason() or mlp


def q_mlp_unsupported_reason(policy: BasePolicy, head: QHead | None = None) -> str | None:
    """
    :param policy: the DQN policy (or another ``head``'s)
    :param head: what the network outputs (default: DQN's Q-values)
    :return: why :class:`HandDerivedQUpdate` cannot run it, or ``None`` when it can
    """
    head = head or Q_VALUES
    q_net = head.network(policy)
    if type(q_net) is not head.network_class:
        return f"network class {type(q_net).__name__} is not the stock {head.network_class.__name__}"
    reason = flat_input_unsupported_reason(policy.observation_space) or flat_extractor_unsupported_reason(
        q_net.features_extractor
    )
    if reason is not None:
        return reason
    mlp = q_mlp(q_net, head)
    if isinstance(mlp, str):
        return f"q_net: {mlp}"
    if any(p.dtype != th.float32 for p in q_net.parameters()):
        return "parameters are not float32"
    return adam_unsupported_reason(policy.optimizer, list(q_net.parameters()))


#: ``reduction="mean"`` as torch's loss kernels take it
_MEAN = 1


_zeros: dict[tuple[th.device, th.dtype], th.Tensor] = {}


def _zero(like: th.Tensor) -> th.Tensor:
    """:return: a kept 0-dim zero on ``like``'s device and dtype"""
    zero = _zeros.get((like.device, like.dtype))
    if zero is None:
        with th.inference_mode(False):  # a normal tensor, usable in any mode
            zero = _zeros[(like.device, like.dtype)] = th.zeros((), device=like.device, dtype=like.dtype)
    return zero


def huber_(d: th.Tensor, weights: th.Tensor | None) -> th.Tensor:
    """:return: the mean (weighted) smooth-L1 loss of TD errors ``d`` (``F.smooth_l1_loss`` with ``beta=1``)"""
    if weights is None:
        # F.smooth_l1_loss's own kernel, without the wrapper's checks, against a kept zero that it broadcasts (same value)
        return th._C._nn.smooth_l1_loss(d, _zero(d), _MEAN, 1.0)  # type: ignore[arg-type]  # the kernel takes an int
    return (F.smooth_l1_loss(d, th.zeros_like(d), reduction="none") * weights).mean()


class QHead:
    """
    What a value network outputs, its loss and that loss's gradient: the part of a Q-learning update that differs
    between DQN (:class:`QValueHead`) and QR-DQN (:class:`sb3_speedups.qrdqn.head.QuantileHead`). ``out`` is the
    network's output as its last ``Linear`` gives it (``[n, outputs]``) or as the module returns it.
    """

    #: the stock network class whose MLP the hand-derived update runs
    network_class: ClassVar[type[BasePolicy]] = QNetwork

    def network(self, policy: BasePolicy) -> BasePolicy:
        """:return: the policy's online network"""
        return policy.q_net  # type: ignore[return-value]

    def target_network(self, policy: BasePolicy) -> BasePolicy:
        """:return: the policy's target network"""
        return policy.q_net_target  # type: ignore[return-value]

    def body(self, network: BasePolicy) -> nn.Module:
        """:return: the network's MLP (``Linear``, activation, ..., ``Linear``)"""
        return network.q_net  # type: ignore[return-value]

    def q_values(self, out: th.Tensor) -> th.Tensor:
        """:return: the action values ``[n, n_actions]`` that the greedy action maximises"""
        raise NotImplementedError

    def next_values(self, out: th.Tensor, actions: th.Tensor | None) -> th.Tensor:
        """:return: what the TD target bootstraps from (``out``: the target network's), at the greedy or given actions"""
        raise NotImplementedError

    def output_grad(
        self, out: th.Tensor, actions: th.Tensor, target: th.Tensor, weights: th.Tensor | None
    ) -> tuple[th.Tensor, Any]:
        """:return: the loss's gradient with respect to ``out`` (valid until the next call) and the step's result"""
        raise NotImplementedError

    def autograd_loss(
        self, out: th.Tensor, actions: th.Tensor, target: th.Tensor, weights: th.Tensor | None
    ) -> tuple[th.Tensor, Any]:
        """:return: the loss as stock computes it (autograd through it) and the step's result"""
        raise NotImplementedError

    def logged_loss(self, results: list[Any], weights: list[th.Tensor] | None) -> th.Tensor:
        """:return: the mean loss of one ``train()`` call's steps, from their results"""
        raise NotImplementedError


class QValueHead(QHead):
    """DQN's: one Q-value per action; the (weighted) Huber loss of the TD errors, which are the step's result."""

    def q_values(self, out: th.Tensor) -> th.Tensor:
        return out

    def next_values(self, out: th.Tensor, actions: th.Tensor | None) -> th.Tensor:
        if actions is None:
            return th.amax(out, dim=1, keepdim=True)  # stock's max(...).values without the indices
        return out.gather(1, actions)

    def output_grad(
        self, out: th.Tensor, actions: th.Tensor, target: th.Tensor, weights: th.Tensor | None
    ) -> tuple[th.Tensor, th.Tensor]:
        index = actions if actions.dtype == th.int64 else actions.long()
        d = out.gather(1, index).sub_(target)
        # d(huber)/d(d) = clamp(d, -1, 1); the mean divides by b.
        grad = d.clamp(-1.0, 1.0)
        if weights is not None:
            grad.mul_(weights)
        grad.div_(out.shape[0])
        return th.zeros_like(out).scatter_(1, index, grad), d

    def autograd_loss(
        self, out: th.Tensor, actions: th.Tensor, target: th.Tensor, weights: th.Tensor | None
    ) -> tuple[th.Tensor, th.Tensor]:
        q = th.gather(out, dim=1, index=actions.long())
        loss = F.smooth_l1_loss(q, target) if weights is None else huber_(q - target, weights)
        return loss, (q - target).detach()

    def logged_loss(self, results: list[Any], weights: list[th.Tensor] | None) -> th.Tensor:
        # Every minibatch has batch_size rows: the mean over all of them is the mean of the per-step losses.
        return huber_(_joined(results), None if weights is None else _joined(weights))


#: DQN's head (it holds nothing)
Q_VALUES = QValueHead()


def _joined(tensors: list[th.Tensor]) -> th.Tensor:
    return tensors[0] if len(tensors) == 1 else th.cat(tensors)


class HandDerivedQUpdate:
    """
    Hand-derived DQN update of an MLP ``QNetwork`` (check :func:`q_mlp_unsupported_reason` first).

    :param policy: the DQN policy; its Q-network's parameters move into one flat buffer and its Adam runs fused
    :param head: what the network outputs and its loss (default: DQN's Q-values and Huber TD loss)
    """

    def __init__(self, policy: BasePolicy, head: QHead | None = None) -> None:
        head = head or Q_VALUES
        reason = q_mlp_unsupported_reason(policy, head)
        if reason is not None:
            raise ValueError(reason)
        self.policy, self.head = policy, head
        q_net = head.network(policy)
        mlp = q_mlp(q_net, head)
        assert not isinstance(mlp, str)
        #: the Q-network's input of observations: float rows, or the hot columns of a one-hot input
        self.inputs = mlp.inputs
        hidden, out = mlp.head()
        assert out is not None and out.bias is not None
        self.flat = FlatParameters(list(q_net.parameters()))
        self.adam = FlatAdam(self.flat, policy.optimizer)
        self.chain = MlpChain(self.flat, [hidden])
        self.w_out, self.b_out = self.flat.data_of(out.weight), self.flat.data_of(out.bias)
        self.gw_out, self.gb_out = self.flat.grad_of(out.weight), self.flat.grad_of(out.bias)

    def is_bound(self, optimizer: bool = True) -> bool:
        """
        :param optimizer: check the optimizer state too (acting only needs the parameters)
        :return: whether the parameters (and optimizer state) still live in the flat buffers
        """
        return self.flat.is_bound() and (not optimizer or self.adam.is_bound())

    def q_values(self, obs: th.Tensor) -> th.Tensor:
        """:return: ``Q(obs, .)`` ``[n, n_actions]`` (overwrites the forward workspace for ``n`` rows)"""
        h = self.chain.forward(self.inputs(obs))[0]
        return self.head.q_values(th.addmm(self.b_out, h, self.w_out.t()))

    def step(
        self,
        obs: th.Tensor,
        actions: th.Tensor,
        target: th.Tensor,
        weights: th.Tensor | None,
        max_grad_norm: float | None,
    ) -> Any:
        """
        One gradient step on the head's loss (DQN: ``mean(w * huber(Q(obs, actions) - target))``).

        :param obs: observations ``[b, ...]``
        :param actions: actions ``[b, 1]`` (any integer or float dtype)
        :param target: TD targets (DQN: ``[b, 1]``)
        :param weights: importance-sampling weights ``[b, 1]``, or ``None``
        :param max_grad_norm: gradient clipping threshold (``None``: no clipping)
        :return: the head's result (DQN: the TD errors ``[b, 1]``)
        """
        h = self.chain.forward(self.inputs(obs))
        h2 = h[0]
        out = th.addmm(self.b_out, h2, self.w_out.t())
        d_out, result = self.head.output_grad(out, actions, target, weights)
        th.mm(d_out.t(), h2, out=self.gw_out)
        th.sum(d_out, 0, out=self.gb_out)
        if self.chain.weights:
            self.chain.backward(th.mm(d_out, self.w_out).unsqueeze(0))
        self.adam.step(None if max_grad_norm is None else self.flat.clip_divisor(max_grad_norm))
        return result


class AutogradQUpdate:
    """
    The stock DQN update step with autograd, for any Q-network (CNN, dueling, ``Dict`` observations): the stock loss,
    its gradient into one flat buffer (a CNN's: as autograd stores it) and one fused Adam step where the optimizer is a
    plain Adam over the Q-network (:class:`~sb3_speedups.common.nn.autograd_step.FlatOptimizerStep`), else the optimizer's own
    calls.

    :param policy: the DQN policy (its ``q_net`` and ``optimizer``)
    :param head: what the network outputs and its loss (default: DQN's Q-values and Huber TD loss)
    """

    def __init__(self, policy: BasePolicy, head: QHead | None = None) -> None:
        self.policy, self.head = policy, head or Q_VALUES
        self.net = self.head.network(policy)
        # A CNN's first fully connected layer has millions of weights: zeroing a flat buffer and adding its gradient
        # into it are two passes more than taking the gradient autograd makes.
        self.optimizer_step = FlatOptimizerStep(self.net, policy.optimizer, take_grads=has_convolutions(self.net))
        self._channels_last = trains_channels_last(self.net, policy.device)

    def is_bound(self, optimizer: bool = True) -> bool:
        """
        :param optimizer: check the optimizer too (acting reads the module's parameters wherever they live)
        :return: whether the optimizer and its state are still the ones the flat step drives
        """
        return not optimizer or self.optimizer_step.is_bound(self.policy.optimizer)

    @th.no_grad()
    def q_values(self, obs: th.Tensor) -> th.Tensor:
        """:return: ``Q(obs, .)`` without gradients"""
        return self.head.q_values(self.net(obs))

    def step(
        self,
        obs: th.Tensor,
        actions: th.Tensor,
        target: th.Tensor,
        weights: th.Tensor | None,
        max_grad_norm: float | None,
    ) -> Any:
        """Same contract as :meth:`HandDerivedQUpdate.step`."""
        out = self.net(to_channels_last(obs) if self._channels_last else obs)
        loss, result = self.head.autograd_loss(out, actions, target, weights)
        self.optimizer_step.backward(loss)
        self.optimizer_step.step(max_grad_norm)  # the target network has no gradients: the Q-network's norm, as stock's
        return result
