"""
One DQN gradient step (Huber loss on Q(s, a) against a given target, gradient clipping, Adam), two ways:

- :class:`HandDerivedQUpdate`: for an MLP ``QNetwork`` (flat ``Box``, ``Discrete``, ``MultiDiscrete`` or
  ``MultiBinary`` observations, ``Linear`` layers with ReLU or Tanh, stock Adam): hand-derived forward and backward
  into preallocated buffers, flat parameters and one fused Adam kernel (:mod:`sb3_speedups.common.nn.optim`),
  clipping without a host sync;
- :class:`AutogradQUpdate`: any other Q-network (dueling heads, CNN, ``Dict`` observations, custom optimizer),
  with autograd and the policy's own optimizer, as stock SB3 does.

Both return the TD errors ``Q(s, a) - target`` (for prioritised replay, and for the logged loss: :func:`huber_`
of all of one ``train()`` call's errors at once, with no ``.item()`` per step). ``weights`` are importance-sampling
weights (``None``: all 1, stock's loss).
The loss, its gradient and the tests that check them: see docs/maths.md, "DQN Huber TD loss".
"""

from __future__ import annotations

import torch as th
import torch.nn.functional as F
from stable_baselines3.common.torch_layers import FlattenExtractor
from stable_baselines3.dqn.policies import DQNPolicy, QNetwork

from sb3_speedups.common.nn.inputs import flat_input_unsupported_reason
from sb3_speedups.common.nn.mlp import Mlp, parse_output_mlp
from sb3_speedups.common.nn.training import MlpChain
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.optim import FlatAdam, FlatOptimizerStep, adam_unsupported_reason
from sb3_speedups.common.torch_utils import to_channels_last, trains_channels_last


def q_mlp(q_net: QNetwork) -> Mlp | str:
    """
    :return: the description of ``q_net.q_net`` taking the observations as SB3 preprocesses them (the executors' input:
        :meth:`~sb3_speedups.common.nn.mlp.Mlp.inputs`), or why the hand-derived update cannot run it
    """
    mlp = parse_output_mlp(q_net.q_net)
    if isinstance(mlp, str):
        return mlp
    mlp = mlp.observing(q_net.observation_space)
    return mlp.head()[0].trainable_reason() or mlp


def q_mlp_unsupported_reason(policy: DQNPolicy) -> str | None:
    """
    :param policy: the DQN policy
    :return: why :class:`HandDerivedQUpdate` cannot run it, or ``None`` when it can
    """
    q_net = policy.q_net
    if type(q_net) is not QNetwork:
        return f"Q-network class {type(q_net).__name__} is not the stock QNetwork"
    reason = flat_input_unsupported_reason(policy.observation_space)
    if reason is not None:
        return reason
    if not isinstance(q_net.features_extractor, FlattenExtractor):
        return "features extractor is not FlattenExtractor"
    mlp = q_mlp(q_net)
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


class HandDerivedQUpdate:
    """
    Hand-derived DQN update of an MLP ``QNetwork`` (check :func:`q_mlp_unsupported_reason` first).

    :param policy: the DQN policy; its Q-network's parameters move into one flat buffer and its Adam runs fused
    """

    def __init__(self, policy: DQNPolicy) -> None:
        reason = q_mlp_unsupported_reason(policy)
        if reason is not None:
            raise ValueError(reason)
        self.policy = policy
        q_net = policy.q_net
        mlp = q_mlp(q_net)
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
        return th.addmm(self.b_out, h, self.w_out.t())

    def step(
        self,
        obs: th.Tensor,
        actions: th.Tensor,
        target: th.Tensor,
        weights: th.Tensor | None,
        max_grad_norm: float,
    ) -> th.Tensor:
        """
        One gradient step on ``mean(w * huber(Q(obs, actions) - target))``.

        :param obs: observations ``[b, ...]``
        :param actions: actions ``[b, 1]`` (any integer or float dtype)
        :param target: TD targets ``[b, 1]``
        :param weights: importance-sampling weights ``[b, 1]``, or ``None``
        :param max_grad_norm: gradient clipping threshold
        :return: the TD errors ``[b, 1]``
        """
        b = obs.shape[0]
        h = self.chain.forward(self.inputs(obs))
        h2 = h[0]
        q = th.addmm(self.b_out, h2, self.w_out.t())
        index = actions if actions.dtype == th.int64 else actions.long()
        d = q.gather(1, index).sub_(target)
        # d(huber)/d(d) = clamp(d, -1, 1); the mean divides by b.
        grad = d.clamp(-1.0, 1.0)
        if weights is not None:
            grad.mul_(weights)
        grad.div_(b)
        d_q = th.zeros_like(q).scatter_(1, index, grad)
        th.mm(d_q.t(), h2, out=self.gw_out)
        th.sum(d_q, 0, out=self.gb_out)
        if self.chain.weights:
            self.chain.backward(th.mm(d_q, self.w_out).unsqueeze(0))
        self.adam.step(self.flat.clip_divisor(max_grad_norm))
        return d


class AutogradQUpdate:
    """
    The stock DQN update step with autograd, for any Q-network (CNN, dueling, ``Dict`` observations): the stock loss,
    its gradient into one flat buffer and one fused Adam step where the optimizer is a plain Adam over the Q-network
    (:class:`~sb3_speedups.common.nn.optim.FlatOptimizerStep`), else the optimizer's own calls.

    :param policy: the DQN policy (its ``q_net`` and ``optimizer``)
    """

    def __init__(self, policy: DQNPolicy) -> None:
        self.policy = policy
        self.optimizer_step = FlatOptimizerStep(policy.q_net, policy.optimizer)
        self._channels_last = trains_channels_last(policy.q_net, policy.device)

    def is_bound(self, optimizer: bool = True) -> bool:
        """
        :param optimizer: check the optimizer too (acting reads the module's parameters wherever they live)
        :return: whether the optimizer and its state are still the ones the flat step drives
        """
        return not optimizer or self.optimizer_step.is_bound(self.policy.optimizer)

    @th.no_grad()
    def q_values(self, obs: th.Tensor) -> th.Tensor:
        """:return: ``Q(obs, .)`` without gradients"""
        return self.policy.q_net(obs)

    def step(
        self,
        obs: th.Tensor,
        actions: th.Tensor,
        target: th.Tensor,
        weights: th.Tensor | None,
        max_grad_norm: float,
    ) -> th.Tensor:
        """Same contract as :meth:`HandDerivedQUpdate.step`."""
        q_values = self.policy.q_net(to_channels_last(obs) if self._channels_last else obs)
        q = th.gather(q_values, dim=1, index=actions.long())
        loss = F.smooth_l1_loss(q, target) if weights is None else huber_(q - target, weights)
        self.optimizer_step.backward(loss)
        self.optimizer_step.step(max_grad_norm)  # the target network has no gradients: the Q-network's norm, as stock's
        return (q - target).detach()
