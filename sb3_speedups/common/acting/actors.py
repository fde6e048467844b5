"""
Batched policy calls for collecting experience, from a frozen copy of the policy synced once per rollout.

- :class:`~sb3_speedups.common.acting.mirror.ParameterMirror`: the plain-tensor copies the actors run on.
- :class:`~sb3_speedups.common.acting.torch_mlp.TorchMlp` (torch) and
  :class:`~sb3_speedups.common.acting.numpy_actor.NumpyActorCritic` (numpy): the acting executors of the MLP
  description (:mod:`sb3_speedups.common.nn.mlp`).
- :class:`FrozenActorCritic`: the actor for an MLP ``ActorCriticPolicy``: one forward for all envs, sampling that draws
  torch's RNG exactly as ``torch.distributions`` does (so the first rollout equals stock SB3's for one seed).
- :class:`ModuleActorCritic`: the same interface for any other policy (CNN, ``Dict`` observations, gSDE, custom),
  calling the policy itself, or a copy of it on the acting device.

Actors are called under ``torch.inference_mode`` and return ``(actions as numpy, values [n, 1], log_probs [n])``,
as SB3's ``policy(obs)`` does after ``.cpu().numpy()``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy, BasePolicy
from stable_baselines3.common.utils import obs_as_tensor
from torch import nn

from sb3_speedups.common.acting.mirror import ParameterMirror
from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.acting.numpy_actor import NumpyActorCritic
from sb3_speedups.common.nn.actor_critic import flat_layout, parse_actor_critic
from sb3_speedups.common.nn.heads import ActionHead, make_head
from sb3_speedups.common.nn.heads.masked import mask_logits, mask_logits_numpy
from sb3_speedups.common.nn.mlp import stack


def box_env_actions(policy: BasePolicy, action_space: spaces.Space) -> Callable[[np.ndarray], np.ndarray]:
    """
    :return: the map from sampled actions to the actions given to the env: SB3's clipping to the ``Box`` bounds,
        or unscaling when the policy squashes its output; identity for other spaces
    """
    if not isinstance(action_space, spaces.Box):
        return lambda actions: actions
    if policy.squash_output:
        return policy.unscale_action
    low, high = action_space.low, action_space.high
    return lambda actions: np.clip(actions, low, high)


def stock_action_shape(action_space: spaces.Space) -> tuple[int, ...] | None:
    """
    :return: ``(-1, *action_space.shape)``, the shape stock's ``ActorCriticPolicy.forward`` gives its actions, where
        it differs from a head's ``[n, action_dim]`` rows (multi-dimensional spaces such as a ``(2, 2)`` ``Box``);
        ``None`` where the head's rows already have it
    """
    shape = action_space.shape
    return (-1, *shape) if shape is not None and len(shape) > 1 else None


class FrozenActorCritic:
    """
    Frozen plain-tensor copy of an MLP ``ActorCriticPolicy`` (observations the MLP executors take, no gSDE) for
    collection.

    :param policy: the policy (check :func:`sb3_speedups.common.nn.actor_critic.mlp_unsupported_reason` first)
    :param head: its action head (:func:`sb3_speedups.common.nn.heads.make_head`)
    :param device: where the copy lives and acts
    """

    def __init__(self, policy: ActorCriticPolicy, head: ActionHead, device: th.device | str = "cpu") -> None:
        self.source, self.head, self.device = policy, head, th.device(device)
        ac = parse_actor_critic(policy)
        if isinstance(ac, str):
            raise ValueError(f"the policy's networks are not plain MLPs: {ac}")
        # Equally shaped policy and value networks run as one batched product per layer; the copies are laid out
        # as ActorCriticMlp's flat buffer (each policy layer next to its value twin), so that a sync is one copy.
        self.stacked = (
            bool(ac.pi.layers)
            and ac.pi.same_shapes(ac.vf)
            and all(p.activation is v.activation for p, v in zip(ac.pi.layers, ac.vf.layers, strict=True))
        )
        order = flat_layout(ac, policy)
        self.mirror = ParameterMirror(order, self.device, keep_order=True)
        lookup = {id(t): c for t, c in zip(order, self.mirror.copies, strict=True)}
        mirrored = ac.map(lambda t: lookup[id(t)])
        chains = [stack([mirrored.pi, mirrored.vf], self._pair)] if self.stacked else [mirrored.pi, mirrored.vf]
        self.latents = [TorchMlp(chain) for chain in chains]
        self.action_net, self.value_net = TorchMlp(mirrored.action), TorchMlp(mirrored.value)
        self.log_std = mirrored.log_std
        self.env_actions = box_env_actions(policy, policy.action_space)
        self.action_shape = stock_action_shape(policy.action_space)
        self._numpy = NumpyActorCritic.build(chains, mirrored.action, mirrored.value) if self.device.type == "cpu" else None

    def _pair(self, copies: list[th.Tensor]) -> th.Tensor:
        """:return: two copies that lie side by side in the mirror as one ``[2, ...]`` view"""
        first, second = copies
        offset = first.storage_offset()
        assert second.storage_offset() == offset + first.numel()
        return self.mirror.flat[offset : offset + 2 * first.numel()].view(2, *first.shape)

    def _latents(self, x: th.Tensor) -> tuple[th.Tensor, th.Tensor]:
        if not self.stacked:
            return self.latents[0](x), self.latents[1](x)
        h = self.latents[0](x)
        return h[0], h[1]

    def sync(self) -> None:
        """Refresh the copy from the policy (once per rollout)."""
        self.mirror.sync()

    def _features(self, obs: np.ndarray | dict[str, np.ndarray]) -> th.Tensor:
        if isinstance(obs, dict):
            return self.latents[0].mlp.inputs({key: th.as_tensor(value, device=self.device) for key, value in obs.items()})
        return self.latents[0].mlp.inputs(th.as_tensor(obs, device=self.device))

    def _acts_in_numpy(self, obs: np.ndarray | dict[str, np.ndarray]) -> bool:
        """:return: whether the numpy executor takes this batch (numpy observations, few enough rows)"""
        if self._numpy is None:
            return False
        rows = next(iter(obs.values())) if isinstance(obs, dict) else obs
        return isinstance(rows, np.ndarray) and self._numpy.accepts(rows.shape[0])

    def act(
        self, obs: np.ndarray | dict[str, np.ndarray], masks: np.ndarray | None = None
    ) -> tuple[np.ndarray, th.Tensor, th.Tensor]:
        """
        :param masks: allowed choices of categorical actions (sb3-contrib's action masks), or ``None``
        :return: sampled actions (shaped as stock's policy shapes them), values ``[n, 1]`` and log-probabilities
            ``[n]`` for a batch of observations (the copy's tensors never require gradients, so no autograd state is
            recorded without any grad-mode context)
        """
        if self._acts_in_numpy(obs):
            assert self._numpy is not None
            out, np_values = self._numpy.forward(obs)
            if masks is not None:
                out = mask_logits_numpy(out, masks)
            np_actions, log_prob = self.head.sample_numpy(out, self.log_std)
            values: th.Tensor = th.from_numpy(np_values)
        else:
            latent_pi, latent_vf = self._latents(self._features(obs))
            values = self.value_net(latent_vf)
            logits = self.action_net(latent_pi)
            actions, log_prob = self.head.sample(logits if masks is None else mask_logits(logits, masks), self.log_std)
            np_actions = (actions if actions.device.type == "cpu" else actions.cpu()).numpy()
        if self.action_shape is not None:
            np_actions = np_actions.reshape(self.action_shape)
        return np_actions, values, log_prob

    def predict_values(self, obs: np.ndarray | dict[str, np.ndarray]) -> th.Tensor:
        """:return: values ``[n]`` of a batch of observations"""
        if self._acts_in_numpy(obs):
            assert self._numpy is not None
            return th.from_numpy(self._numpy.forward(obs)[1]).view(-1)
        return self.value_net(self._latents(self._features(obs))[1]).view(-1)

    def reset_noise(self, n_envs: int) -> None:
        raise RuntimeError("gSDE policies use ModuleActorCritic")


def _plain_forward(policy: nn.Module) -> bool:
    """:return: whether the policy computes its forward as stock ``ActorCriticPolicy`` does"""
    cls = type(policy)
    return isinstance(policy, ActorCriticPolicy) and all(
        getattr(cls, name) is getattr(ActorCriticPolicy, name) for name in ("forward", "_get_action_dist_from_latent")
    )


def policy_latents(policy: ActorCriticPolicy, obs: Any) -> tuple[th.Tensor, th.Tensor]:
    """
    The actor's and the critic's latents, as ``ActorCriticPolicy.forward`` computes them.

    :param policy: the policy
    :param obs: observations as tensors
    :return: ``(latent_pi, latent_vf)``
    """
    features = policy.extract_features(obs)
    if policy.share_features_extractor:
        return policy.mlp_extractor(features)
    return policy.mlp_extractor.forward_actor(features[0]), policy.mlp_extractor.forward_critic(features[1])


def standard_head(policy: nn.Module) -> ActionHead | None:
    """:return: the action head to use instead of the policy's distribution objects, or ``None`` to call the policy"""
    if not _plain_forward(policy) or getattr(policy, "use_sde", False):
        return None
    assert isinstance(policy, ActorCriticPolicy)
    return make_head(policy.action_dist, policy.action_space)


def _non_leaf_tensors(obj: Any, found: dict[int, th.Tensor], seen: set[int], depth: int = 0) -> None:
    """Collect tensors that autograd produced (``deepcopy`` refuses them) held by ``obj``'s attributes, recursively."""
    if id(obj) in seen or depth > 8:
        return
    seen.add(id(obj))
    if isinstance(obj, th.Tensor):
        if obj.grad_fn is not None:
            found[id(obj)] = obj
        return
    if isinstance(obj, dict):
        values: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        values = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        values = vars(obj).values()
    else:
        return
    for value in values:
        _non_leaf_tensors(value, found, seen, depth + 1)


def copy_policy(policy: BasePolicy, device: th.device | str) -> BasePolicy:
    """
    :return: a deep copy of ``policy`` on ``device``, without its optimizer (nothing drawn from the RNG); tensors
        that autograd produced (gSDE's exploration matrix) are copied detached
    """
    found: dict[int, th.Tensor] = {}
    _non_leaf_tensors(policy, found, set())
    memo: dict[int, Any] = {key: tensor.detach().clone() for key, tensor in found.items()}
    optimizer = policy.__dict__.pop("optimizer", None)
    try:
        clone = copy.deepcopy(policy, memo)
    finally:
        if optimizer is not None:
            policy.optimizer = optimizer
    return clone.to(device)


def _rebind(module: nn.Module, tensors: list[th.Tensor]) -> None:
    """Make ``module``'s parameters, then its buffers, use ``tensors`` (in ``parameters()``, ``buffers()`` order)."""
    params = list(module.parameters())
    for p, t in zip(params, tensors, strict=False):
        p.data = t
    buffers = tensors[len(params) :]
    owners = [(owner, name) for owner in module.modules() for name, b in owner.named_buffers(recurse=False) if b is not None]
    for (owner, name), t in zip(owners, buffers, strict=True):
        owner._buffers[name] = t


class ModuleActorCritic:
    """
    The actor for any ``ActorCriticPolicy``: calls the policy itself, or a copy of it on ``device`` when the policy
    lives elsewhere (a GPU) or ``copy=True``. Standard action distributions are sampled with the heads of
    :mod:`sb3_speedups.common.nn.heads`.

    :param policy: the training policy
    :param device: where to act
    :param copy: act from a copy even when ``device`` is the policy's own
    """

    def __init__(self, policy: ActorCriticPolicy, device: th.device | str = "cpu", copy: bool = False) -> None:
        self.source, self.device = policy, th.device(device)
        same = th.device(policy.device) == self.device
        self.policy: Any = policy if same and not copy else copy_policy(policy, self.device)
        self.mirror: ParameterMirror | None = None
        if self.policy is not policy:
            self.mirror = ParameterMirror([*policy.parameters(), *policy.buffers()], self.device)
            _rebind(self.policy, self.mirror.copies)
        self.head = standard_head(policy)
        self.env_actions = box_env_actions(policy, policy.action_space)
        self.action_shape = stock_action_shape(policy.action_space)

    def sync(self) -> None:
        """Refresh the copy (if any) from the training policy (once per rollout)."""
        if self.mirror is not None:
            self.mirror.sync()

    @th.inference_mode()
    def act(
        self, obs: np.ndarray | dict[str, np.ndarray], masks: np.ndarray | None = None
    ) -> tuple[np.ndarray, th.Tensor, th.Tensor]:
        """
        :param masks: allowed choices of categorical actions (sb3-contrib's action masks), or ``None``
        :return: sampled actions (shaped as stock's policy shapes them), values ``[n, 1]`` and log-probabilities
            ``[n]`` for a batch of observations
        """
        obs_tensor = obs_as_tensor(obs, self.device)
        policy = self.policy
        if self.head is None:
            if masks is not None:
                raise ValueError(f"{type(policy).__name__} has no standard head to mask")
            actions, values, log_prob = policy(obs_tensor)
            return actions.cpu().numpy(), values, log_prob  # the policy shapes its actions itself
        latent_pi, latent_vf = self._latents(obs_tensor)
        values = policy.value_net(latent_vf)
        out = policy.action_net(latent_pi)
        actions, log_prob = self.head.sample(
            out if masks is None else mask_logits(out, masks), getattr(policy, "log_std", None)
        )
        np_actions = actions.cpu().numpy()
        return (np_actions if self.action_shape is None else np_actions.reshape(self.action_shape)), values, log_prob

    def _latents(self, obs: Any) -> tuple[th.Tensor, th.Tensor]:
        """:return: the actor's and the critic's latents of ``obs`` (tensors), as the policy computes them"""
        return policy_latents(self.policy, obs)

    @th.inference_mode()
    def predict_values(self, obs: np.ndarray | dict[str, np.ndarray]) -> th.Tensor:
        """:return: values ``[n]`` of a batch of observations"""
        return self.policy.predict_values(obs_as_tensor(obs, self.device)).view(-1)

    def reset_noise(self, n_envs: int) -> None:
        """Draw new gSDE exploration noise (as stock SB3 does on the training policy)."""
        self.policy.reset_noise(n_envs)
