"""
The numpy acting executor of an MLP description (:mod:`sb3_speedups.common.nn.mlp`), for the CPU, and the forward
of an actor-critic built from it.

For the few observations of one vectorised step the cost of a policy call is per-call overhead, which is a few
times lower for numpy than for torch; the parameters are numpy views of the described tensors (an actor's mirror),
so a sync of the mirror updates them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from sb3_speedups.common.nn.mlp import NONE, Mlp

# OpenBLAS's single-thread limit is 4 * 65,536; a margin below it.
_SINGLE_THREAD_MNK = 65_536


def _affine(x: np.ndarray, weight_t: np.ndarray, bias: np.ndarray | None) -> np.ndarray:
    y = np.matmul(x, weight_t)
    return y if bias is None else np.add(y, bias, out=y)


class NumpyMlp:
    """
    An MLP run with numpy on views of its description's CPU tensors. Stacked, inputs ``[n, in]`` broadcast over the
    ``G`` networks and the output is ``[G, n, out]``. With a one-hot input the first layer is a gather, and the input
    the hot columns (:meth:`inputs`).

    :param mlp: the network (check :meth:`unsupported_reason`)
    """

    def __init__(self, mlp: Mlp) -> None:
        reason = self.unsupported_reason(mlp)
        if reason is not None:
            raise ValueError(reason)
        self.mlp = mlp
        self.layers: list[tuple[np.ndarray, np.ndarray | None, Callable[[np.ndarray], Any] | None]] = [
            (
                layer.weight.transpose(-2, -1).numpy(),
                None if layer.bias is None else (layer.bias.unsqueeze(1) if mlp.stacked else layer.bias).numpy(),
                None if layer.activation is NONE else layer.activation.numpy,
            )
            for layer in mlp.layers
        ]
        # the products' sizes (a one-hot first layer runs none)
        products = self.layers[1:] if mlp.one_hot is not None else self.layers
        self.max_layer_size = max((int(w.shape[-2]) * int(w.shape[-1]) for w, _, _ in products), default=0)

    @staticmethod
    def unsupported_reason(mlp: Mlp) -> str | None:
        """:return: why numpy cannot run ``mlp`` (an activation without a numpy kernel), or ``None``"""
        for layer in mlp.layers:
            if layer.activation.numpy is None:
                return f"activation {layer.activation.name} has no numpy kernel"
        return None

    def inputs(self, obs: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
        """:return: the input of observations: float32 rows ``[n, in]``, or a one-hot input's hot columns ``[n, k]``"""
        return self.mlp.inputs_numpy(obs)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """:return: the output of :meth:`inputs` (fresh arrays)"""
        one_hot = self.mlp.one_hot
        for k, (weight_t, bias, act) in enumerate(self.layers):
            x = one_hot.matmul_numpy(x, weight_t) if k == 0 and one_hot is not None else np.matmul(x, weight_t)
            if bias is not None:
                np.add(x, bias, out=x)
            if act is not None:
                act(x)
        return x


class NumpyActorCritic:
    """
    The forward of an MLP actor-critic on the CPU with numpy. Results equal torch's within float32 rounding.

    :param chains: ``[stacked policy and value networks]`` or ``[policy network, value network]``
    :param action_net: the action net, one ``Linear`` layer
    :param value_net: the value net, one ``Linear`` layer
    """

    def __init__(self, chains: list[NumpyMlp], action_net: NumpyMlp, value_net: NumpyMlp) -> None:
        self.chains, self.action_net, self.value_net = chains, action_net, value_net
        self.max_layer_size = max(net.max_layer_size for net in [*chains, action_net, value_net])
        # the heads' (weight_t, bias), applied without a call of the whole net
        self._action, self._value = action_net.layers[0][:2], value_net.layers[0][:2]

    @classmethod
    def build(cls, chains: list[Mlp], action_net: Mlp, value_net: Mlp) -> NumpyActorCritic | None:
        """
        :param chains: the latents' networks on CPU tensors, as :class:`NumpyActorCritic` takes them
        :return: their numpy forward, or ``None`` when an activation has no numpy kernel or a head is not one
            ``Linear`` layer
        """
        heads = (action_net, value_net)
        if any(len(net.layers) != 1 or net.layers[0].activation is not NONE for net in heads):
            return None
        if any(NumpyMlp.unsupported_reason(mlp) is not None for mlp in chains):
            return None
        return cls([NumpyMlp(mlp) for mlp in chains], NumpyMlp(action_net), NumpyMlp(value_net))

    def accepts(self, n: int) -> bool:
        """
        :param n: observations in the batch
        :return: whether every matrix product of the batch stays single-threaded in numpy's BLAS. OpenBLAS splits a
            product over threads above ``m * n * k = 262,144``, and its threads then spin on every core for a while,
            starving the env workers; larger batches act through torch.
        """
        return n * self.max_layer_size <= _SINGLE_THREAD_MNK

    def forward(self, obs: np.ndarray | dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """:return: the action net's output ``[n, n_out]`` and the values ``[n, 1]`` (float32, fresh arrays)"""
        x = self.chains[0].inputs(obs)
        if len(self.chains) == 1:
            latents = self.chains[0](x)
            latent_pi, latent_vf = latents[0], latents[1]
        else:
            latent_pi, latent_vf = self.chains[0](x), self.chains[1](x)
        return _affine(latent_pi, *self._action), _affine(latent_vf, *self._value)
