"""
The description of an SB3 MLP ``ActorCriticPolicy`` (``mlp_extractor`` + ``action_net`` + ``value_net``), from the
one MLP parser (:func:`~sb3_speedups.common.nn.mlp.parse_mlp`), and the flat parameter layouts built from it.

When the policy and value networks have the same layer sizes (the default ``pi=[64, 64], vf=[64, 64]``) the flat
layout puts each policy layer next to its value twin, so that the pair is a plain ``[2, ...]`` view of the buffer.
"""

from __future__ import annotations

import sys

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeGuard

import torch as th
from stable_baselines3.common.policies import ActorCriticPolicy, MultiInputActorCriticPolicy
from torch import nn

from sb3_speedups.common.nn.inputs import flat_extractor_unsupported_reason, flat_input_unsupported_reason
from sb3_speedups.common.nn.mlp import NONE, Layer, Mlp, biases, parse_mlp


@dataclass(frozen=True)
class ActorCritic:
    """The four MLPs of an ``ActorCriticPolicy`` and its ``log_std`` (``None`` without one)."""

    pi: Mlp
    vf: Mlp
    action: Mlp
    value: Mlp
    log_std: th.Tensor | None

    def map(self, fn: Callable[[th.Tensor], th.Tensor]) -> ActorCritic:
        """:return: the same networks on ``fn(tensor)`` of each tensor"""
        log_std = None if self.log_std is None else fn(self.log_std)
        return ActorCritic(self.pi.map(fn), self.vf.map(fn), self.action.map(fn), self.value.map(fn), log_std)

    def heads(self) -> tuple[Layer, Layer] | None:
        """:return: the action and value layers when each net is one ``Linear`` layer, else ``None``"""
        nets = (self.action, self.value)
        if any(len(net.layers) != 1 or net.layers[0].activation is not NONE for net in nets):
            return None
        return self.action.layers[0], self.value.layers[0]


def parse_actor_critic(policy: ActorCriticPolicy) -> ActorCritic | str:
    """
    :return: the description of ``policy``'s networks on its own parameters, the policy and value networks taking
        its observations as SB3 preprocesses them (:meth:`~sb3_speedups.common.nn.mlp.Mlp.observing`), or why they are
        not plain MLPs
    """
    nets = (policy.mlp_extractor.policy_net, policy.mlp_extractor.value_net, policy.action_net, policy.value_net)
    parsed = [parse_mlp(net) for net in nets]
    reasons = [reason for reason in parsed if isinstance(reason, str)]
    if reasons:
        return reasons[0]
    pi, vf, action, value = (mlp for mlp in parsed if not isinstance(mlp, str))
    space = policy.observation_space
    return ActorCritic(pi.observing(space), vf.observing(space), action, value, getattr(policy, "log_std", None))


def _is_plain_policy(policy: nn.Module) -> TypeGuard[ActorCriticPolicy]:
    """
    :return: whether ``policy`` is SB3's ``ActorCriticPolicy`` itself or its ``MultiInputActorCriticPolicy`` (the
        same networks, another default features extractor), or sb3-contrib's maskable twins of these (the same
        networks and attributes, their own base class)
    """
    plain: tuple[type, ...] = (ActorCriticPolicy, MultiInputActorCriticPolicy)
    # looked up, not imported: a maskable policy exists only once sb3-contrib is loaded
    maskable = sys.modules.get("sb3_contrib.common.maskable.policies")
    if maskable is not None:
        plain += (maskable.MaskableActorCriticPolicy, maskable.MaskableMultiInputActorCriticPolicy)
    return type(policy) in plain


def mlp_unsupported_reason(policy: nn.Module) -> str | None:
    """
    :param policy: an SB3 policy
    :return: why :class:`~sb3_speedups.common.nn.actor_critic_mlp.ActorCriticMlp` cannot run it, or ``None`` when it can
    """
    if not _is_plain_policy(policy):
        return f"policy class {type(policy).__name__} is not the plain MlpPolicy (ActorCriticPolicy)"
    reason = flat_input_unsupported_reason(policy.observation_space)
    if reason is not None:
        return reason
    reason = flat_extractor_unsupported_reason(policy.features_extractor) or flat_extractor_unsupported_reason(
        policy.vf_features_extractor
    )
    if reason is not None:
        return reason
    extractor = (policy.mlp_extractor.policy_net, policy.mlp_extractor.value_net)
    pi, vf = (parse_mlp(net) for net in extractor)
    if (
        isinstance(pi, str)
        or isinstance(vf, str)
        or not all(isinstance(net, nn.Sequential) for net in extractor)
        or pi.trainable_reason()
        or vf.trainable_reason()
    ):
        return "mlp_extractor is not Linear layers with a Tanh or ReLU activation"
    space = policy.observation_space
    reason = pi.observing(space).trainable_reason() or vf.observing(space).trainable_reason()
    if reason is not None:
        return reason
    if pi.layers and vf.layers and pi.activation is not vf.activation:
        return "policy and value networks use different activations"
    if type(policy.action_net) is not nn.Linear or type(policy.value_net) is not nn.Linear:
        return "action_net or value_net is not a Linear layer"
    if any(p.dtype != th.float32 for p in policy.parameters()):
        return "parameters are not float32"
    return None


def flat_layout(ac: ActorCritic, policy: ActorCriticPolicy) -> list[th.Tensor]:
    """
    :param ac: ``policy``'s description (:func:`parse_actor_critic`)
    :return: the policy's parameters in the order of the flat buffer: each policy layer's weight and bias next to its
        value twin's when the networks have the same shapes, then the heads, then the rest (``log_std``)
    """
    layout: list[th.Tensor] = []
    if ac.pi.same_shapes(ac.vf):
        for p, v, p_bias, v_bias in zip(ac.pi.layers, ac.vf.layers, biases(ac.pi.layers), biases(ac.vf.layers), strict=True):
            layout += [p.weight, v.weight, p_bias, v_bias]
    else:
        layout += ac.pi.tensors() + ac.vf.tensors()
    layout += ac.action.tensors() + ac.value.tensors()
    return layout + [p for p in policy.parameters() if all(p is not q for q in layout)]


def critic_parameters(ac: ActorCritic) -> list[th.Tensor]:
    """:return: the value network's parameters (``mlp_extractor.value_net`` and ``value_net``), input to output"""
    return ac.vf.tensors() + ac.value.tensors()


def split_layout(ac: ActorCritic, policy: ActorCriticPolicy) -> list[th.Tensor]:
    """
    :return: the policy's parameters with every actor parameter (policy layers, action net, ``log_std``) before every
        critic parameter (:func:`critic_parameters`), so that each part is one contiguous range of the flat buffer
    """
    critic = critic_parameters(ac)
    return [p for p in policy.parameters() if all(p is not q for q in critic)] + critic
