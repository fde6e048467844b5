"""The interface every action head implements, its scratch state, and the one-draw sampler the categorical heads share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch as th


def sample_one_per_row(probs: th.Tensor) -> th.Tensor:
    """
    ``torch.multinomial(probs, 1, replacement=True)`` without its validation passes (two host syncs): one exponential
    race, ``argmax(probs / q)`` with ``q ~ Exp(1)`` drawn from torch's RNG, which is how torch draws a single
    sample, so the draws and the RNG state afterwards are the same (``tests/test_inference.py`` checks it).

    :param probs: valid probabilities ``[n, k]`` (e.g. a softmax)
    :return: one category index per row ``[n, 1]`` (int64)
    """
    q = th.empty_like(probs).exponential_()
    return th.argmax(th.div(probs, q, out=q), dim=-1, keepdim=True)


@dataclass(slots=True, kw_only=True)
class HeadWorkspace:
    """
    A head's buffers for minibatches of one size, made by :meth:`ActionHead.workspace`; each head adds its own.

    :param column_source: the vector :attr:`column` was made from
    :param column: ``column_source.unsqueeze(1)``, kept while the same vector comes back (see :func:`column_of`)
    """

    column_source: th.Tensor | None = None
    column: th.Tensor | None = None


def column_of(ws: HeadWorkspace, vector: th.Tensor) -> th.Tensor:
    """:return: ``vector.unsqueeze(1)``, kept in ``ws`` while the same vector comes back (a view is not free)"""
    view = ws.column
    if view is None or ws.column_source is not vector:
        view = ws.column = vector.unsqueeze(1)
        ws.column_source = vector
    return view


W = TypeVar("W", bound=HeadWorkspace)


class ActionHead(Generic[W]):
    """
    One action distribution family. ``out`` is the action net's output ``[n, n_outputs]``; ``log_std`` is the
    state-independent log standard deviation of Gaussian heads (``None`` for the others). The gradients that
    :meth:`backward` writes are derived in ``docs/maths.md``, "Action heads".

    :param n_outputs: width of the action net's output
    """

    has_log_std = False

    def __init__(self, n_outputs: int) -> None:
        self.n_outputs = n_outputs

    def sample(self, out: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        """:return: sampled actions (shaped as the env expects per row) and their log-probabilities ``[n]``"""
        raise NotImplementedError

    def sample_numpy(self, out: np.ndarray, log_std: th.Tensor | None) -> tuple[np.ndarray, th.Tensor]:
        """
        :meth:`sample` from an action-net output computed with numpy on the CPU (same draws from torch's RNG).

        :return: sampled actions as numpy and their log-probabilities ``[n]``
        """
        actions, log_prob = self.sample(th.from_numpy(out), log_std)
        return actions.numpy(), log_prob

    def log_prob_entropy(self, out: th.Tensor, actions: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        """:return: differentiable log-probabilities ``[n]`` and entropies ``[n]`` of ``actions`` (float, as stored)"""
        raise NotImplementedError

    def training_actions(self, actions: th.Tensor) -> dict[str, th.Tensor]:
        """
        :param actions: stored actions ``[N, action_dim]`` (float32)
        :return: the per-sample action tensors :meth:`forward` needs (first dim ``N``), computed once per update
        """
        return {"actions": actions}

    def workspace(self, n: int, device: th.device) -> W:
        """:return: preallocated buffers for a minibatch of ``n`` rows"""
        raise NotImplementedError

    def forward(
        self,
        ws: W,
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        """Write the log-probabilities and the negated entropies (``[n]`` each); keep what ``backward`` needs in ``ws``."""
        raise NotImplementedError

    def backward(
        self,
        ws: W,
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        """
        Gradient of ``sum_i g_log_prob[i] * log_prob[i] + entropy_grad * sum_i entropy[i]`` with respect to ``out``
        (written into ``d_out``) and to ``log_std`` (written into ``d_log_std``).
        """
        raise NotImplementedError
