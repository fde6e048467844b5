"""
A2C's update of a ``CnnPolicy`` on the convolutions' activations that its rollout already computed.

A2C trains once per rollout, on exactly the rollout's observations, with the weights that acted on them: stock's
training forward through the convolutions recomputes what acting computed. Acting here keeps each convolution's
output (:class:`KeptConvActorCritic`: the policy's own layers and operations, so the same actions as before), and
``train()`` (:func:`kept_conv_update`) runs the layers after the convolutions through autograd, then the
convolutions' backward by hand, on the whole rollout at once in channels-last order (oneDNN's faster backward).

The result is stock's update within float32 rounding: acting ran the convolutions on ``n_envs`` rows at a time,
stock's training forward on the whole rollout (another blocking of the same sums). Measured: docs/benchmarks.md.
"""

from __future__ import annotations

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticCnnPolicy, ActorCriticPolicy
from stable_baselines3.common.preprocessing import preprocess_obs
from stable_baselines3.common.torch_layers import NatureCNN
from torch import nn
from torch.nn import functional as F

from sb3_speedups.a2c.update import A2CLossConfig, a2c_loss
from sb3_speedups.common.acting.actors import ModuleActorCritic, standard_head
from sb3_speedups.common.nn.heads import ActionHead
from sb3_speedups.common.nn.autograd_step import FlatOptimizerStep

# Kept activations of one rollout at most (float32 bytes): NatureCNN keeps ~84 KB per observation, so the RL Zoo's
# Atari A2C rollout (16 envs x 5 steps) needs ~7 MB; longer rollouts train as before.
MAX_KEPT_BYTES = 256 * 2**20


def _convolutions(policy: ActorCriticPolicy) -> list[nn.Conv2d] | None:
    """:return: the convolutions of a NatureCNN stack (each followed by a ReLU, then a Flatten), else ``None``"""
    cnn = getattr(policy.features_extractor, "cnn", None)
    if type(cnn) is not nn.Sequential or len(cnn) < 3 or type(cnn[-1]) is not nn.Flatten:
        return None
    layers = list(cnn)[:-1]
    convs, relus = layers[0::2], layers[1::2]
    if len(convs) != len(relus) or any(type(r) is not nn.ReLU for r in relus):
        return None
    if any(type(c) is not nn.Conv2d or c.padding_mode != "zeros" or c.bias is None for c in convs):
        return None
    return convs  # type: ignore[return-value]


def kept_conv_reason(policy: ActorCriticPolicy, rollout_rows: int, device: th.device) -> str | None:
    """:return: why :class:`KeptConvActorCritic` cannot act for ``policy``'s rollouts of ``rollout_rows`` rows, or ``None``"""
    if type(policy) not in (ActorCriticCnnPolicy, ActorCriticPolicy) or type(policy.features_extractor) is not NatureCNN:
        return "not SB3's NatureCNN policy"
    if not policy.share_features_extractor or device.type != "cpu" or th.device(policy.device) != device:
        return "separate feature extractors or not on the CPU"
    if standard_head(policy) is None or not isinstance(policy.observation_space, spaces.Box):
        return "no standard action head or not Box observations"
    convs = _convolutions(policy)
    if convs is None:
        return "the convolutions are not Conv2d-ReLU pairs"
    with th.no_grad():
        shapes = _output_shapes(convs, policy.observation_space.shape)
    kept = rollout_rows * sum(int(np.prod(shape)) for shape in shapes) * 4
    return f"the rollout's activations need {kept} bytes" if kept > MAX_KEPT_BYTES else None


def _output_shapes(convs: list[nn.Conv2d], obs_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    x = th.zeros(1, *obs_shape)
    shapes = []
    for conv in convs:
        x = conv(x)
        shapes.append(tuple(x.shape[1:]))
    return shapes


class KeptConvActorCritic(ModuleActorCritic):
    """
    :class:`~sb3_speedups.common.acting.actors.ModuleActorCritic` that keeps the rollout's activations: each
    convolution's (ReLU'd) output, rows ``[step * n_envs, (step + 1) * n_envs)`` for the rollout's step ``step``.

    :param policy: the training policy (check :func:`kept_conv_reason` first); acting runs on it, as the parent's
    :param rollout_rows: ``n_steps * n_envs``
    """

    def __init__(self, policy: ActorCriticPolicy, rollout_rows: int) -> None:
        super().__init__(policy, policy.device)
        convs = _convolutions(policy)
        assert convs is not None
        self.convs = convs
        self.rows = 0
        with th.inference_mode(False), th.no_grad():  # normal tensors: the update back-propagates from them
            shapes = _output_shapes(convs, policy.observation_space.shape)  # type: ignore[arg-type]
            # in channels-last order, which the update's backward takes (a copy into it costs as much as a plain one)
            self.outputs = [
                th.empty(rollout_rows, *shape, device=policy.device).contiguous(memory_format=th.channels_last)
                for shape in shapes
            ]

    def sync(self) -> None:
        """Start a rollout (called once before it)."""
        self.rows = 0
        super().sync()

    def complete(self) -> bool:
        """:return: whether the activations of a whole rollout are kept"""
        return self.rows == self.outputs[0].shape[0]

    def _latents(self, obs: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        """:return: the policy's latents of ``obs``, keeping each convolution's output in this rollout's rows"""
        policy = self.policy
        x = preprocess_obs(obs, policy.observation_space, policy.normalize_images)
        assert isinstance(x, th.Tensor)  # a Box space (kept_conv_reason)
        start, n = self.rows, x.shape[0]
        keep = 0 <= start and start + n <= self.outputs[0].shape[0]  # (-1: no rollout started since the update)
        for conv, kept in zip(self.convs, self.outputs, strict=True):
            # NatureCNN's layers, as its forward runs them
            x = F.relu(conv._conv_forward(x, conv.weight, conv.bias))
            if keep:
                kept[start : start + n].copy_(x)
        self.rows = start + n if keep else self.outputs[0].shape[0] + 1  # a longer rollout is not kept
        return policy.mlp_extractor(policy.features_extractor.linear(x.flatten(1)))


def _channels_last(x: th.Tensor) -> th.Tensor:
    return x.contiguous(memory_format=th.channels_last)


def kept_conv_update(
    actor: KeptConvActorCritic,
    step: FlatOptimizerStep,
    observations: th.Tensor,
    actions: th.Tensor,
    advantages: th.Tensor,
    returns: th.Tensor,
    cfg: A2CLossConfig,
) -> th.Tensor:
    """
    Stock A2C's gradient step on the whole rollout, from the kept activations (check :meth:`KeptConvActorCritic.complete`).

    :param actor: the actor that acted for the whole rollout
    :param step: the policy's flat optimizer step
    :param observations: the rollout's observations ``[n, C, H, W]``, time-major (the buffer's flat order)
    :param actions: its actions ``[n, ...]``
    :param advantages: its advantages ``[n]``
    :param returns: its returns ``[n]``
    :param cfg: the loss's coefficients
    :return: the statistics (:data:`~sb3_speedups.a2c.update.A2C_STATS`)
    """
    policy, head = actor.policy, actor.head
    assert isinstance(head, ActionHead) and actor.complete()
    last = actor.outputs[-1]
    flat = last.flatten(1).requires_grad_()  # a copy in NCHW order, as the Flatten layer gives it
    latent_pi, latent_vf = policy.mlp_extractor(policy.features_extractor.linear(flat))
    log_prob, entropy = head.log_prob_entropy(policy.action_net(latent_pi), actions, getattr(policy, "log_std", None))
    loss, stats = a2c_loss(log_prob, entropy, policy.value_net(latent_vf).flatten(), advantages, returns, cfg)
    step.backward(loss)  # the layers after the convolutions, and the gradient of their input
    assert flat.grad is not None
    grad = _channels_last(flat.grad.view(last.shape))
    with th.no_grad():
        # the uint8 observations change order first: the cheap copy (the scaled values are the same)
        x0 = preprocess_obs(_channels_last(observations), policy.observation_space, policy.normalize_images)
        assert isinstance(x0, th.Tensor)
        inputs = [x0, *actor.outputs[:-1]]
        for k in reversed(range(len(actor.convs))):
            conv, output = actor.convs[k], actor.outputs[k]
            grad = th.ops.aten.threshold_backward(grad, output, 0)  # ReLU
            grad_input, grad_weight, grad_bias = th.ops.aten.convolution_backward(
                grad,
                inputs[k],
                conv.weight,
                [conv.out_channels],
                list(conv.stride),
                list(conv.padding),  # type: ignore[arg-type]
                list(conv.dilation),
                False,
                [0, 0],
                conv.groups,
                [k > 0, True, True],
            )
            assert conv.bias is not None  # kept_conv_reason
            for param, param_grad in ((conv.weight, grad_weight), (conv.bias, grad_bias)):
                if param.grad is None:  # an optimizer's own zero_grad() sets them to None
                    param.grad = param_grad
                else:  # the flat buffer's views, zeroed
                    param.grad.add_(param_grad)
            grad = grad_input
    step.step(cfg.max_grad_norm)
    actor.rows = -1  # the weights moved: the kept outputs are stale until the next rollout
    return stats
