"""
The observations an MLP description (:mod:`sb3_speedups.common.nn.mlp`) takes, and SB3's preprocessing folded into
its first layer.

SB3's ``preprocess_obs`` + ``FlattenExtractor`` give an MLP float rows: a flat ``Box`` or a ``MultiBinary`` as floats,
a ``Discrete(n)`` as a one-hot row of ``n``, a ``MultiDiscrete(nvec)`` as the one-hot rows of its components side by
side. A one-hot row times ``W^T`` is a sum of rows of ``W^T``: :class:`OneHotInput` computes the first layer as that
gather, on the hot columns (``int64 [n, k]``, one per component), and never makes the one-hot matrix. Its weight
gradient is the layer's output gradient added into the gathered rows; the input itself has no gradient.

A ``Dict`` of such entries (SB3's ``MultiInputPolicy``: ``CombinedExtractor`` flattens each entry, in the space's key
order, and concatenates) becomes the same float rows at once (:class:`FloatRows`: each entry written into its columns
of one row block, a one-hot entry as its hot ones), so the first layer stays one product, as stock's, with stock's
rounding: ``k`` products of the entries' column blocks would be ``k`` small calls and round otherwise. Inputs that are
not a product (a recurrent layer's) take any of these spaces as :class:`FloatRows`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch as th
from gymnasium import spaces
from stable_baselines3.common.preprocessing import is_image_space
from stable_baselines3.common.torch_layers import BaseFeaturesExtractor, CombinedExtractor, FlattenExtractor
from torch import nn


@dataclass(frozen=True)
class OneHotInput:
    """The one-hot blocks of a ``Discrete`` or ``MultiDiscrete`` observation in the first layer's input columns."""

    #: the first input column of each component's block (``(0,)`` for ``Discrete``)
    offsets: tuple[int, ...]

    def columns(self, obs: th.Tensor) -> th.Tensor:
        """:return: the hot input columns ``[n, k]`` (int64) of observations ``[n]`` or ``[n, k]`` (``obs`` if it is them)"""
        cols = obs.reshape(obs.shape[0], -1) if obs.dim() != 2 else obs
        cols = cols if cols.dtype == th.int64 else cols.long()
        if not any(self.offsets):
            return cols
        return cols + th.tensor(self.offsets, device=cols.device)

    def columns_numpy(self, obs: np.ndarray) -> np.ndarray:
        """:return: :meth:`columns` of numpy observations"""
        cols = np.asarray(obs).reshape(len(obs), -1).astype(np.int64, copy=False)
        return cols + np.asarray(self.offsets, dtype=np.int64) if any(self.offsets) else cols

    def addmm(
        self, bias: th.Tensor | None, columns: th.Tensor, weight_t: th.Tensor, out: th.Tensor | None = None
    ) -> th.Tensor:
        """
        ``addmm(bias, one_hot(columns), weight_t)`` (``baddbmm`` for stacked ``[G, in, out]`` weights) as a gather of
        ``weight_t``'s rows: the same arguments as torch's, so that an executor calls either for its first layer.

        :param bias: ``[out]`` (``[G, 1, out]`` stacked), or ``None``
        :param columns: the hot columns ``[n, k]``
        :param weight_t: the first layer's transposed weight ``[in, out]`` or ``[G, in, out]``
        :param out: where to write the ``[n, out]`` (``[G, n, out]``) result
        """
        n, k = columns.shape
        if k == 1:
            result = th.index_select(weight_t, -2, columns.view(-1), out=out)  # type: ignore[call-overload]
        else:
            rows = th.index_select(weight_t, -2, columns.reshape(-1)).unflatten(-2, (n, k))
            result = th.sum(rows, -2, out=out)  # type: ignore[call-overload]
        return result if bias is None else result.add_(bias)

    def matmul_numpy(self, columns: np.ndarray, weight_t: np.ndarray) -> np.ndarray:
        """:return: ``one_hot(columns) @ weight_t`` (a fresh array), the numpy twin of :meth:`addmm` without the bias"""
        if columns.shape[1] == 1:
            return np.take(weight_t, columns[:, 0], axis=-2)
        return np.take(weight_t, columns, axis=-2).sum(axis=-2)

    def weight_grad(self, grad_weight_t: th.Tensor, columns: th.Tensor, d: th.Tensor) -> None:
        """
        Write the first layer's weight gradient ``(d^T @ one_hot(columns))^T``: each row of ``d`` added into the rows
        of its hot columns.

        :param grad_weight_t: the transposed weight gradient ``[in, out]`` (``[G, in, out]``), overwritten
        :param columns: the hot columns ``[n, k]`` of the forward
        :param d: the gradient of the first layer's output (before its activation) ``[n, out]`` (``[G, n, out]``)
        """
        grad_weight_t.zero_()
        for component in range(columns.shape[1]):
            grad_weight_t.index_add_(-2, columns[:, component], d)


@dataclass(frozen=True)
class RowsEntry:
    """One entry of a ``Dict`` observation (or the whole of another) in the float rows: its key and its columns."""

    key: str
    #: its first column in the rows
    start: int
    #: its number of columns (a one-hot entry: the sum of its blocks)
    width: int
    #: the one-hot entry's blocks' first columns relative to ``start`` (``None``: float values)
    one_hot: OneHotInput | None


@dataclass(frozen=True)
class FloatRows:
    """
    Observations as the float rows that SB3's ``preprocess_obs`` and ``FlattenExtractor`` (``CombinedExtractor`` for a
    ``Dict``: entries side by side) give an MLP.
    """

    #: a ``Dict``'s entries, or one entry under the key ``""`` for another space
    entries: tuple[RowsEntry, ...]
    #: the rows' width (the first layer's input size)
    width: int

    def rows(
        self, obs: th.Tensor | np.ndarray | Mapping[str, th.Tensor | np.ndarray], device: th.device | str = "cpu"
    ) -> th.Tensor:
        """:return: the float rows ``[n, width]`` of observations (tensors or arrays of ``n`` rows under each key)"""
        obs = obs if isinstance(obs, Mapping) else {"": obs}
        n = len(obs[self.entries[0].key])
        out = th.zeros((n, self.width), dtype=th.float32, device=device)
        for entry in self.entries:
            x = th.as_tensor(obs[entry.key], device=device)
            if entry.one_hot is None:
                out[:, entry.start : entry.start + entry.width] = x.reshape(n, -1)
            else:
                out.scatter_(1, entry.one_hot.columns(x.reshape(n, -1)) + entry.start, 1.0)
        return out

    def rows_numpy(self, obs: np.ndarray | Mapping[str, np.ndarray]) -> np.ndarray:
        """:return: :meth:`rows` of numpy observations"""
        obs = obs if isinstance(obs, Mapping) else {"": obs}
        n = len(obs[self.entries[0].key])
        out = np.zeros((n, self.width), dtype=np.float32)
        for entry in self.entries:
            x = np.asarray(obs[entry.key]).reshape(n, -1)
            if entry.one_hot is None:
                out[:, entry.start : entry.start + entry.width] = x
            else:
                np.put_along_axis(out, entry.one_hot.columns_numpy(x) + entry.start, 1.0, axis=1)
        return out


def float_rows(space: spaces.Space) -> FloatRows:
    """:return: the float rows of ``space``'s observations (check :func:`flat_input_unsupported_reason` first)"""
    entries, start = [], 0
    for key, sub in space.spaces.items() if isinstance(space, spaces.Dict) else [("", space)]:
        if isinstance(sub, spaces.Discrete):
            width = int(sub.n)
        elif isinstance(sub, spaces.MultiDiscrete):
            width = int(np.sum(sub.nvec))
        else:
            width = math.prod(sub.shape or ())
        entries.append(RowsEntry(key, start, width, one_hot_input(sub)))
        start += width
    return FloatRows(tuple(entries), start)


def float_rows_unless_box(space: spaces.Space) -> FloatRows | None:
    """:return: :func:`float_rows` of ``space``, ``None`` for a flat ``Box`` (its observations, flattened, are its rows)"""
    return None if isinstance(space, spaces.Box) else float_rows(space)


def one_hot_input(space: spaces.Space) -> OneHotInput | None:
    """:return: the one-hot input of a ``Discrete`` or ``MultiDiscrete`` space, ``None`` for float rows (others)"""
    if isinstance(space, spaces.Discrete):
        return OneHotInput((0,))
    if isinstance(space, spaces.MultiDiscrete):
        return OneHotInput(tuple(int(x) for x in np.cumsum(space.nvec) - space.nvec))
    return None


def flat_input_unsupported_reason(space: spaces.Space) -> str | None:
    """
    :return: why the MLP executors cannot take ``space``'s observations (the fallback's ``preprocess_obs`` then
        runs), or ``None``: a flat ``Box`` or a ``MultiBinary`` (float rows), a ``Discrete`` or a one-dimensional
        ``MultiDiscrete`` counting from 0 (one-hot input), or a ``Dict`` of those (float rows)
    """
    if isinstance(space, spaces.Dict):
        for key, sub in space.spaces.items():
            reason = None if isinstance(sub, spaces.Dict) else flat_input_unsupported_reason(sub)
            if reason is not None or isinstance(sub, spaces.Dict):
                return f"Dict observation entry {key!r}: {reason or 'a nested Dict'}"
        return None
    if isinstance(space, spaces.Box) and not is_image_space(space):
        return None
    if isinstance(space, spaces.MultiBinary):
        return None
    # SB3's one-hot of a value counted from another start than 0 is not that value's block (or raises)
    if isinstance(space, spaces.Discrete) and space.start == 0:
        return None
    if isinstance(space, spaces.MultiDiscrete) and space.nvec.ndim == 1 and not np.any(space.start):
        return None
    return f"observation space {type(space).__name__} is not a flat Box, Discrete, MultiDiscrete or MultiBinary"


def flat_extractor_unsupported_reason(extractor: BaseFeaturesExtractor) -> str | None:
    """
    :return: why ``extractor`` is not a plain flattening of the observations (SB3's ``FlattenExtractor``, or a
        ``CombinedExtractor`` that only flattens each entry: the ``MultiInputPolicy`` default for vector entries), or
        ``None``
    """
    if type(extractor) is FlattenExtractor:
        return None
    if type(extractor) is CombinedExtractor and all(type(sub) is nn.Flatten for sub in extractor.extractors.values()):
        return None
    return f"features extractor {type(extractor).__name__} is not FlattenExtractor (or a CombinedExtractor of flat entries)"
