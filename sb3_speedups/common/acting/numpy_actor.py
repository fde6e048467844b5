"""
The acting forward of :class:`~sb3_speedups.common.acting.actors.LeanActorCritic` in numpy, for the CPU.

For the few observations of one vectorised step the cost of a policy call is per-call overhead, which is a few
times lower for numpy than for torch; the parameters are numpy views of the actor's mirror, so its sync updates them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch as th
import torch.nn.functional as F

if TYPE_CHECKING:
    from sb3_speedups.common.acting.actors import LeanActorCritic, LeanMlp

_NUMPY_ACTIVATIONS: dict[Any, Callable[[np.ndarray], Any]] = {
    th.tanh: lambda x: np.tanh(x, out=x),
    F.relu: lambda x: np.maximum(x, 0, out=x),
    None: lambda x: x,
}


# OpenBLAS's single-thread limit is 4 * 65,536; a margin below it.
_SINGLE_THREAD_MNK = 65_536
_NumpyLayer = tuple[np.ndarray, "np.ndarray | None", Callable[[np.ndarray], Any]]


class NumpyActorCritic:
    """
    The forward of a :class:`LeanActorCritic` on the CPU with numpy, reading the same mirrored parameters (numpy views
    of the mirror, so a sync updates them). For the few observations of one vectorised step the cost is per-call
    overhead, which is a few times lower for numpy than for torch (measured here, 8 CartPole observations, 64x64
    policy and value networks: the whole act 65-85 us with numpy, 195-275 us with torch). Results equal torch's
    within float32 rounding.

    :param chains: ``[stacked layers]`` (policy and value networks as one ``[2, in, out]`` product per layer) or
        ``[policy layers, value layers]``; each layer ``(weight_t [.., in, out], bias or None, in-place activation)``
    :param action_net: ``(weight_t [in, n_out], bias)``
    :param value_net: ``(weight_t [in, 1], bias)``
    """

    def __init__(
        self,
        chains: list[list[_NumpyLayer]],
        action_net: tuple[np.ndarray, np.ndarray | None],
        value_net: tuple[np.ndarray, np.ndarray | None],
    ) -> None:
        self.chains, self.action_net, self.value_net = chains, action_net, value_net
        weights = [w for chain in chains for w, _, _ in chain] + [action_net[0], value_net[0]]
        self.max_layer_size = max(int(w.shape[-2]) * int(w.shape[-1]) for w in weights)

    def accepts(self, n: int) -> bool:
        """
        :param n: observations in the batch
        :return: whether every matrix product of the batch stays single-threaded in numpy's BLAS. OpenBLAS splits a
            product over threads above ``m * n * k = 262,144``, and its threads then spin on every core for a while:
            measured here, PPO on HalfCheetah-v5 (8 envs, 256x256 networks) with a BatchedSubprocVecEnv worker
            starved by them, 1,384 us per step instead of 477 us. Larger batches act through torch.
        """
        return n * self.max_layer_size <= _SINGLE_THREAD_MNK

    @classmethod
    def build(cls, actor: LeanActorCritic) -> NumpyActorCritic | None:
        """:return: the numpy forward of ``actor`` (on the CPU), or ``None`` when an activation has no numpy twin"""

        def layers(mlp: LeanMlp) -> list[_NumpyLayer] | None:
            out: list[_NumpyLayer] = []
            for weight, bias, act in mlp.layers:
                if act not in _NUMPY_ACTIVATIONS:
                    return None
                out.append((weight.numpy().T, None if bias is None else bias.numpy(), _NUMPY_ACTIVATIONS[act]))
            return out

        if actor.stacked:
            if any(act not in _NUMPY_ACTIVATIONS for _, _, act in actor.layers):
                return None
            chains: list[list[_NumpyLayer]] = [[(w.numpy(), b.numpy(), _NUMPY_ACTIVATIONS[act]) for w, b, act in actor.layers]]
        else:
            pi, vf = layers(actor.pi), layers(actor.vf)
            if pi is None or vf is None:
                return None
            chains = [pi, vf]
        heads = [layers(net) for net in (actor.action_net, actor.value_net)]
        if any(head is None or len(head) != 1 or head[0][2] is not _NUMPY_ACTIVATIONS[None] for head in heads):
            return None
        (action_w, action_b, _), (value_w, value_b, _) = heads[0][0], heads[1][0]  # type: ignore[index]
        return cls(chains, (action_w, action_b), (value_w, value_b))

    @staticmethod
    def _affine(x: np.ndarray, weight_t: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
        y = np.matmul(x, weight_t)
        return y if bias is None else np.add(y, bias, out=y)

    def forward(self, obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """:return: the action net's output ``[n, n_out]`` and the values ``[n, 1]`` (float32, fresh arrays)"""
        x = np.asarray(obs, dtype=np.float32)
        x = x.reshape(x.shape[0], -1)
        latents = []
        for chain in self.chains:
            h = x
            for weight_t, bias, act in chain:
                h = act(self._affine(h, weight_t, bias))
            latents.append(h)
        latent_pi, latent_vf = (latents[0][0], latents[0][1]) if len(latents) == 1 else (latents[0], latents[1])
        return self._affine(latent_pi, *self.action_net), self._affine(latent_vf, *self.value_net)
