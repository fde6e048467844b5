"""
One description of an MLP, made by one parser, with one activation table.

:class:`Mlp` is ``Linear`` layers, each followed by at most one activation (:class:`Activation`), as the weight and
bias tensors of the module (or views of them: a flat buffer's, a mirror's). Stacked, each tensor holds ``G`` equally
shaped networks side by side (``[G, out, in]`` weights), which run as one batched product. The executors read it:

- :mod:`sb3_speedups.common.nn.training`: forward and backward into kept buffers (:class:`MlpChain`);
- :mod:`sb3_speedups.common.nn.blocked`: forward of many rows, a block at a time, into kept buffers;
- :mod:`sb3_speedups.common.acting.torch_mlp`: torch forward for acting;
- :mod:`sb3_speedups.common.acting.numpy_actor`: numpy forward for acting on the CPU.

Each executor runs the same operations as the module's own forward; which activations an executor can run is in the
table (a kind without a numpy or a backward kernel is reported, and the caller falls back). A description may take
one-hot observations (:attr:`Mlp.one_hot`, ``Discrete`` and ``MultiDiscrete`` ones): every executor then runs its first
layer as a gather of the hot columns' weights (:class:`~sb3_speedups.common.nn.inputs.OneHotInput`). A description
may take ``Dict`` observations (:attr:`Mlp.dict_input`): :meth:`Mlp.inputs` makes them the float rows the executors take.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from torch import nn

from sb3_speedups.common.nn.inputs import FloatRows, OneHotInput, float_rows, one_hot_input

# The ops' C++ callables: calling them skips the Python frame of ``OpOverload.__call__``.
_TANH_BACKWARD = getattr(th.ops.aten.tanh_backward.grad_input, "_op", th.ops.aten.tanh_backward.grad_input)
_THRESHOLD_BACKWARD = getattr(th.ops.aten.threshold_backward.grad_input, "_op", th.ops.aten.threshold_backward.grad_input)


@dataclass(frozen=True, eq=False)
class Activation:
    """An activation and its kernel in each executor (``None`` where an executor has none: it falls back)."""

    #: ``"tanh"``, ``"relu"``, ``"none"``, or the class name of another parameter-free module
    name: str
    #: out of place, torch's kernel (the module's own forward)
    torch: Callable[[th.Tensor], th.Tensor]
    #: in place, torch's kernel
    torch_: Callable[[th.Tensor], th.Tensor] | None
    #: in place on a numpy array
    numpy: Callable[[np.ndarray], Any] | None
    #: ``grad *= activation'(x)`` in place, given the activation's output ``y``: ``backward(grad, y)``
    backward: Callable[[th.Tensor, th.Tensor], th.Tensor] | None
    #: whether the training forward runs the numpy kernel on CPU tensors (numpy's vectorised tanh is the faster one)
    numpy_on_cpu: bool = False


def _identity(x: Any, *_: Any) -> Any:
    return x


TANH = Activation(
    "tanh",
    th.tanh,
    th.Tensor.tanh_,
    lambda x: np.tanh(x, out=x),
    lambda grad, y: _TANH_BACKWARD(grad, y, grad_input=grad),
    numpy_on_cpu=True,
)
RELU = Activation(
    "relu",
    F.relu,
    th.Tensor.relu_,
    lambda x: np.maximum(x, 0, out=x),
    lambda grad, y: _THRESHOLD_BACKWARD(grad, y, 0.0, grad_input=grad),
)
#: no activation after a layer
NONE = Activation("none", _identity, _identity, _identity, _identity)
#: the activation modules every executor runs
ACTIVATIONS: dict[type[nn.Module], Activation] = {nn.Tanh: TANH, nn.ReLU: RELU}


def module_activation(module: nn.Module) -> Activation:
    """:return: a parameter-free activation module outside the table, run by calling it (torch acting only)"""
    return Activation(type(module).__name__, module, None, None, None)


@dataclass(frozen=True)
class Layer:
    """``activation(x @ weight.T + bias)``; stacked, ``G`` such layers side by side."""

    #: ``[out, in]``, or ``[G, out, in]`` stacked
    weight: th.Tensor
    #: ``[out]`` (``[G, out]`` stacked), or ``None``
    bias: th.Tensor | None
    activation: Activation


@dataclass(frozen=True)
class Mlp:
    """``Linear`` layers, each followed by at most one activation, input to output."""

    layers: tuple[Layer, ...]
    #: the first layer's input as the hot columns of one-hot blocks (``Discrete`` or ``MultiDiscrete``
    #: observations), or ``None``: float rows
    one_hot: OneHotInput | None = None
    #: the entries of ``Dict`` observations, which :meth:`inputs` concatenates into float rows, or ``None``
    dict_input: FloatRows | None = None

    def observing(self, space: spaces.Space) -> Mlp:
        """:return: the same network taking ``space``'s observations as SB3 preprocesses them"""
        rows = float_rows(space) if isinstance(space, spaces.Dict) else None
        return replace(self, one_hot=one_hot_input(space), dict_input=rows)

    def inputs(self, obs: th.Tensor | dict[str, th.Tensor]) -> th.Tensor:
        """
        :return: the executors' input for observations (a tensor, or a dict of tensors or arrays): float rows
            ``[n, in]``, or the hot columns ``[n, k]``
        """
        if self.dict_input is not None:
            assert isinstance(obs, dict)
            first = obs[self.dict_input.entries[0].key]
            return self.dict_input.rows(obs, first.device if isinstance(first, th.Tensor) else "cpu")
        assert not isinstance(obs, dict)
        if self.one_hot is not None:
            return self.one_hot.columns(obs)
        return obs if obs.dim() == 2 and obs.dtype == th.float32 else obs.reshape(obs.shape[0], -1).float()

    def inputs_numpy(self, obs: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
        """:return: :meth:`inputs` of numpy observations"""
        if self.dict_input is not None:
            assert isinstance(obs, dict)
            return self.dict_input.rows_numpy(obs)
        assert not isinstance(obs, dict)
        if self.one_hot is not None:
            return self.one_hot.columns_numpy(obs)
        x = np.asarray(obs, dtype=np.float32)
        return x if x.ndim == 2 else x.reshape(x.shape[0], -1)

    @property
    def stacked(self) -> bool:
        """:return: whether the tensors hold ``G`` networks side by side"""
        return bool(self.layers) and self.layers[0].weight.dim() == 3

    @property
    def activation(self) -> Activation | None:
        """:return: the activation of every layer, or ``None`` when the layers differ (or there are none)"""
        kinds = {id(layer.activation): layer.activation for layer in self.layers}
        return next(iter(kinds.values())) if len(kinds) == 1 else None

    def tensors(self) -> list[th.Tensor]:
        """:return: weights and biases, input to output"""
        return [t for layer in self.layers for t in (layer.weight, layer.bias) if t is not None]

    def map(self, fn: Callable[[th.Tensor], th.Tensor]) -> Mlp:
        """:return: the same network on ``fn(tensor)`` of each tensor (e.g. its copy in a mirror)"""
        return replace(
            self,
            layers=tuple(
                replace(lay, weight=fn(lay.weight), bias=None if lay.bias is None else fn(lay.bias)) for lay in self.layers
            ),
        )

    def head(self) -> tuple[Mlp, Layer | None]:
        """:return: the layers but the last (taking this network's input), and the last (``None`` when there are none)"""
        return replace(self, layers=self.layers[:-1]), self.layers[-1] if self.layers else None

    def same_shapes(self, other: Mlp) -> bool:
        """:return: whether both have layers of the same shapes, all with biases (so they can be stacked)"""
        return [lay.weight.shape for lay in self.layers] == [lay.weight.shape for lay in other.layers] and all(
            lay.bias is not None for lay in (*self.layers, *other.layers)
        )

    def trainable_reason(self) -> str | None:
        """:return: why the training executors cannot run this (all layers activated, one hand-derived kind, biases)"""
        activation = self.activation
        if self.one_hot is not None and not self.layers:
            return "a one-hot input without a Linear layer to gather from"
        if self.layers and (activation is None or activation.backward is None or activation is NONE):
            return "not Linear layers with a Tanh or ReLU activation"
        if any(lay.bias is None for lay in self.layers):
            return "a Linear layer has no bias"
        return None


def biases(layers: Sequence[Layer]) -> list[th.Tensor]:
    """:return: the layers' biases (the training and blocked executors need one in every layer)"""
    found = [layer.bias for layer in layers if layer.bias is not None]
    if len(found) != len(layers):
        raise ValueError("a Linear layer has no bias")
    return found


def stack(mlps: Sequence[Mlp], stacked: Callable[[list[th.Tensor]], th.Tensor]) -> Mlp:
    """
    :param mlps: networks of the same shapes, with biases (:meth:`Mlp.same_shapes`), and the same activations
    :param stacked: the ``[G, ...]`` tensor of ``G`` equally shaped tensors (which must lie side by side)
    :return: the networks as one stacked :class:`Mlp`
    """
    layers = zip(*(m.layers for m in mlps), strict=True)
    return replace(
        mlps[0],
        layers=tuple(
            Layer(stacked([lay.weight for lay in group]), stacked(biases(group)), group[0].activation) for group in layers
        ),
    )


def parse_mlp(module: nn.Module) -> Mlp | str:
    """
    The one parser of an MLP.

    :param module: an ``nn.Linear``, or an ``nn.Sequential`` of ``nn.Linear`` layers each followed by at most one
        parameter-free module (an activation: one of :data:`ACTIVATIONS`, else run by calling it)
    :return: its description on the module's own parameters, or why it is not such an MLP
    """
    if type(module) is nn.Linear:
        modules: list[nn.Module] = [module]
    elif isinstance(module, nn.Sequential):
        modules = list(module.children())
    else:
        return f"{type(module).__name__} is not an nn.Sequential of nn.Linear layers"
    layers: list[Layer] = []
    for child in modules:
        if type(child) is nn.Linear:
            layers.append(Layer(child.weight, child.bias, NONE))
        elif (
            layers
            and layers[-1].activation is NONE
            and not any(True for _ in child.parameters())
            and not isinstance(child, nn.Flatten)
        ):
            activation = ACTIVATIONS.get(type(child)) or module_activation(child)
            layers[-1] = replace(layers[-1], activation=activation)
        else:
            return f"{type(child).__name__} is not an nn.Linear or an activation after one"
    return Mlp(tuple(layers))


def parse_output_mlp(module: nn.Module) -> Mlp | str:
    """
    :param module: ``Linear, act, ..., Linear`` (as an SB3 ``QNetwork.q_net``)
    :return: its description when the training and blocked executors can run it, else why not
    """
    mlp = parse_mlp(module)
    if isinstance(mlp, str):
        return mlp
    hidden, last = mlp.head()
    if last is None or last.activation is not NONE:
        return "not Linear layers with a Tanh or ReLU activation, then a Linear layer"
    reason = hidden.trainable_reason() or (None if last.bias is not None else "a Linear layer has no bias")
    return mlp if reason is None else reason
