"""
The maths of SB3's action distributions on plain tensors, without ``torch.distributions`` objects.

Each head turns the action net's output (logits or means) into samples, log-probabilities and entropies, three
ways: ``sample`` for collection (drawing from torch's RNG exactly as ``torch.distributions`` does, so a rollout
matches stock SB3 for the same seed), ``log_prob_entropy`` for autograd, and ``forward``/``backward`` for the
hand-derived PPO update (no autograd graph: the gradients of ``log_prob`` and ``entropy`` are written out below).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    Distribution,
    MultiCategoricalDistribution,
)

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


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


def _column(ws: dict[str, Any], vector: th.Tensor) -> th.Tensor:
    """:return: ``vector.unsqueeze(1)``, kept in ``ws`` while the same vector comes back (a view costs ~2 us)"""
    cached = ws.get("column")
    if cached is None or cached[0] is not vector:
        cached = ws["column"] = (vector, vector.unsqueeze(1))
    return cached[1]


class ActionHead:
    """
    One action distribution family. ``out`` is the action net's output ``[n, n_outputs]``; ``log_std`` is the
    state-independent log standard deviation of Gaussian heads (``None`` for the others).

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

    def workspace(self, n: int, device: th.device) -> dict[str, Any]:
        """:return: preallocated buffers for a minibatch of ``n`` rows"""
        return {}

    def forward(
        self,
        ws: dict[str, Any],
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
        ws: dict[str, Any],
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


class CategoricalHead(ActionHead):
    """
    ``Discrete`` (one block) and ``MultiDiscrete`` (one categorical per block, log-probs and entropies summed).

    :param nvec: number of choices of each block
    """

    def __init__(self, nvec: list[int]) -> None:
        super().__init__(sum(nvec))
        self.nvec = nvec
        self.discrete = len(nvec) == 1
        self._race: tuple[th.Tensor, np.ndarray, np.ndarray] | None = None  # sample_numpy's kept buffers
        # Equal blocks are handled as one [n, k, m] tensor; unequal ones block by block.
        self.uniform = len(set(nvec)) == 1
        self.bounds = [(sum(nvec[:j]), sum(nvec[: j + 1])) for j in range(len(nvec))]

    def _blocks(self, x: th.Tensor) -> list[th.Tensor]:
        if self.uniform:
            return [x.view(x.shape[0], len(self.nvec), self.nvec[0])]
        return [x[:, start:end] for start, end in self.bounds]

    def sample(self, out: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        # As torch's Categorical: normalised logits, softmax probabilities, one multinomial draw per block.
        if self.discrete:
            logits = out - out.logsumexp(dim=-1, keepdim=True)
            sample = sample_one_per_row(F.softmax(logits, dim=-1))
            return sample.view(-1), logits.gather(-1, sample).view(-1)
        samples, log_probs = [], []
        for start, end in self.bounds:
            logits = out[:, start:end]
            logits = logits - logits.logsumexp(dim=-1, keepdim=True)
            sample = sample_one_per_row(F.softmax(logits, dim=-1))
            samples.append(sample)
            log_probs.append(logits.gather(-1, sample))
        return th.cat(samples, dim=1), th.cat(log_probs, dim=1).sum(dim=1)

    def sample_numpy(self, out: np.ndarray, log_std: th.Tensor | None) -> tuple[np.ndarray, th.Tensor]:
        if not self.discrete:
            return super().sample_numpy(out, log_std)
        # One Discrete block in numpy (a dozen small numpy calls cost less than torch's logsumexp alone); the
        # exponential race draws from torch's RNG as sample_one_per_row does, so the same actions are sampled.
        shifted = out - out.max(axis=1, keepdims=True)
        exp = np.exp(shifted)
        total = exp.sum(axis=1, keepdims=True)
        q_tensor, q, rows = self._race_buffers(out.shape)
        q_tensor.exponential_()
        np.divide(exp, total, out=exp)
        actions = np.argmax(np.divide(exp, q, out=exp), axis=1)
        # the chosen entries of shifted - log(total): the same float operations as on the whole array
        log_prob = shifted[rows, actions] - np.log(total[:, 0])
        return actions, th.from_numpy(log_prob)

    def _race_buffers(self, shape: tuple[int, ...]) -> tuple[th.Tensor, np.ndarray, np.ndarray]:
        """:return: a kept float32 tensor of ``shape`` for the exponential draws, its numpy view, and the row indices"""
        buffers = self._race
        if buffers is None or buffers[1].shape != shape:
            with th.inference_mode(False):
                q = th.empty(shape, dtype=th.float32)
            buffers = self._race = (q, q.numpy(), np.arange(shape[0]))
        return buffers

    def log_prob_entropy(self, out: th.Tensor, actions: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        index = actions.long().view(out.shape[0], len(self.nvec))
        log_prob, entropy = out.new_zeros(out.shape[0]), out.new_zeros(out.shape[0])
        for j, (start, end) in enumerate(self.bounds):
            logp_all = F.log_softmax(out[:, start:end], dim=-1)
            log_prob = log_prob + logp_all.gather(-1, index[:, j : j + 1]).squeeze(-1)
            entropy = entropy - (logp_all.exp() * logp_all).sum(-1)
        return log_prob, entropy

    def training_actions(self, actions: th.Tensor) -> dict[str, th.Tensor]:
        index = actions.long().view(actions.shape[0], len(self.nvec))
        starts = th.tensor([start for start, _ in self.bounds], device=actions.device)
        onehot = th.zeros(actions.shape[0], self.n_outputs, dtype=actions.dtype, device=actions.device)
        onehot.scatter_(1, index + starts, 1.0)
        return {"index": index.unsqueeze(-1) if self.uniform else index, "onehot": onehot}

    def workspace(self, n: int, device: th.device) -> dict[str, Any]:
        k = len(self.nvec)
        ws = {name: th.empty(n, self.n_outputs, device=device) for name in ("logp_all", "p", "tmp")}
        shape = (n, k, 1) if self.uniform else (n, k)
        ws["picked"] = th.empty(shape, device=device)
        ws["picked_neg_entropy"] = th.empty(shape, device=device)
        return ws

    def forward(
        self,
        ws: dict[str, Any],
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        logp_all, p, tmp = ws["logp_all"], ws["p"], ws["tmp"]
        n, index = out.shape[0], actions["index"]
        ws["onehot"] = actions["onehot"]
        views = ws.get("views")
        if views is None or views[0] is not out or views[1] is not log_prob or views[2] is not neg_entropy:
            # One block: write straight into the outputs; several: per-block values, then their sum. The buffers
            # are reused from one minibatch to the next, so their views are made once.
            picked = log_prob.view(n, 1, 1) if self.discrete else ws["picked"]
            block_neg_ent = neg_entropy.view(n, 1, 1) if self.discrete else ws["picked_neg_entropy"]
            blocks = (self._blocks(out)[0], self._blocks(logp_all)[0], self._blocks(tmp)[0]) if self.uniform else None
            views = ws["views"] = (out, log_prob, neg_entropy, picked, block_neg_ent, blocks)
        picked, block_neg_ent, blocks = views[3], views[4], views[5]
        ws["block_neg_entropy"] = block_neg_ent
        if blocks is not None:
            th.log_softmax(blocks[0], 2, out=blocks[1])
            th.gather(blocks[1], 2, index, out=picked)
        else:
            for j, (start, end) in enumerate(self.bounds):
                th.log_softmax(out[:, start:end], 1, out=logp_all[:, start:end])
                th.gather(logp_all[:, start:end], 1, index[:, j : j + 1], out=picked[:, j : j + 1])
        th.exp(logp_all, out=p)
        th.mul(p, logp_all, out=tmp)
        # Per-block sum(p * log p) (the negated block entropy) is needed by the entropy gradient.
        if blocks is not None:
            th.sum(blocks[2], 2, keepdim=True, out=block_neg_ent)
        else:
            for j, (start, end) in enumerate(self.bounds):
                th.sum(tmp[:, start:end], 1, keepdim=True, out=block_neg_ent[:, j : j + 1])
        if not self.discrete:
            th.sum(picked.view(n, -1), 1, out=log_prob)
            th.sum(block_neg_ent.view(n, -1), 1, out=neg_entropy)

    def backward(
        self,
        ws: dict[str, Any],
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        # d log p(a) / d logits = onehot(a) - p ;  d H / d logits = -p * (log p + H)   (per block)
        logp_all, p, tmp, onehot = ws["logp_all"], ws["p"], ws["tmp"], ws["onehot"]
        th.sub(onehot, p, out=d_out)
        d_out.mul_(_column(ws, g_log_prob))
        if entropy_grad != 0.0:
            block_neg_ent = ws["block_neg_entropy"]
            for j, (tmp_block, logp_block) in enumerate(zip(self._blocks(tmp), self._blocks(logp_all), strict=True)):
                th.sub(logp_block, block_neg_ent if self.uniform else block_neg_ent[:, j : j + 1], out=tmp_block)
            tmp.mul_(p)
            d_out.sub_(tmp, alpha=entropy_grad)


class BernoulliHead(ActionHead):
    """``MultiBinary``: independent Bernoulli per dimension (log-probs and entropies summed)."""

    def sample(self, out: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        actions = th.bernoulli(th.sigmoid(out))
        return actions, -F.binary_cross_entropy_with_logits(out, actions, reduction="none").sum(dim=1)

    def log_prob_entropy(self, out: th.Tensor, actions: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        log_prob = -F.binary_cross_entropy_with_logits(out, actions, reduction="none").sum(dim=1)
        entropy = F.binary_cross_entropy_with_logits(out, th.sigmoid(out), reduction="none").sum(dim=1)
        return log_prob, entropy

    def workspace(self, n: int, device: th.device) -> dict[str, Any]:
        return {name: th.empty(n, self.n_outputs, device=device) for name in ("sigma", "tmp")}

    def forward(
        self,
        ws: dict[str, Any],
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        # log p(a) = a * l - softplus(l) ;  H = softplus(l) - l * sigmoid(l)
        sigma, tmp = ws["sigma"], ws["tmp"]
        ws["out"], ws["actions"] = out, actions["actions"]
        softplus = F.softplus(out)
        th.sigmoid(out, out=sigma)
        th.mul(actions["actions"], out, out=tmp)
        tmp.sub_(softplus)
        th.sum(tmp, 1, out=log_prob)
        th.mul(out, sigma, out=tmp)
        tmp.sub_(softplus)
        th.sum(tmp, 1, out=neg_entropy)

    def backward(
        self,
        ws: dict[str, Any],
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        # d log p / d l = a - sigmoid(l) ;  d H / d l = -l * sigmoid(l) * (1 - sigmoid(l))
        sigma, tmp = ws["sigma"], ws["tmp"]
        th.sub(ws["actions"], sigma, out=d_out)
        d_out.mul_(_column(ws, g_log_prob))
        if entropy_grad != 0.0:
            th.mul(sigma, sigma, out=tmp)
            tmp.neg_().add_(sigma).mul_(ws["out"])  # sigma * (1 - sigma) * l
            d_out.sub_(tmp, alpha=entropy_grad)


class DiagGaussianHead(ActionHead):
    """``Box`` without gSDE: a diagonal Gaussian with a state-independent ``log_std`` parameter."""

    has_log_std = True

    def sample(self, out: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        assert log_std is not None
        # As SB3's DiagGaussianDistribution + torch's Normal.rsample / log_prob.
        std = th.ones_like(out) * log_std.exp()
        actions = out + th.empty_like(out).normal_() * std
        log_prob = -((actions - out) ** 2) / (2 * std**2) - std.log() - _LOG_SQRT_2PI
        return actions, log_prob.sum(dim=1)

    def log_prob_entropy(self, out: th.Tensor, actions: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        assert log_std is not None
        z = (actions - out) * th.exp(-log_std)
        log_prob = (-0.5 * z**2 - log_std - _LOG_SQRT_2PI).sum(dim=1)
        entropy = (0.5 + _LOG_SQRT_2PI + log_std).sum().expand(out.shape[0])
        return log_prob, entropy

    def workspace(self, n: int, device: th.device) -> dict[str, Any]:
        return {"z": th.empty(n, self.n_outputs, device=device), "z2": th.empty(n, self.n_outputs, device=device)}

    def forward(
        self,
        ws: dict[str, Any],
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        assert log_std is not None
        z, z2 = ws["z"], ws["z2"]
        inv_std = th.exp(-log_std)
        th.sub(actions["actions"], out, out=z)
        z.mul_(inv_std)  # z = (a - mu) / std
        th.mul(z, z, out=z2)
        th.sum(z2, 1, out=log_prob)
        constant = log_std.sum() + self.n_outputs * _LOG_SQRT_2PI
        log_prob.mul_(-0.5).sub_(constant)
        # The entropy does not depend on the state: sum(0.5 + log sqrt(2 pi) + log_std).
        neg_entropy.copy_((-(constant + 0.5 * self.n_outputs)).expand_as(neg_entropy))
        ws["inv_std"] = inv_std

    def backward(
        self,
        ws: dict[str, Any],
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        # d log p / d mu = z / std ;  d log p / d log_std = z^2 - 1 ;  d H / d log_std = 1 (per sample)
        assert d_log_std is not None
        z, z2 = ws["z"], ws["z2"]
        th.mul(z, ws["inv_std"], out=d_out)
        d_out.mul_(_column(ws, g_log_prob))
        th.mv(z2.t(), g_log_prob, out=d_log_std)
        d_log_std.sub_(g_log_prob.sum() - entropy_grad * g_log_prob.shape[0])


def make_head(action_dist: Distribution, action_space: spaces.Space) -> ActionHead | None:
    """
    :param action_dist: the policy's SB3 distribution
    :param action_space: the action space
    :return: the matching head, or ``None`` for distributions without one (gSDE, squashed Gaussian, custom)
    """
    if type(action_dist) is CategoricalDistribution:
        assert isinstance(action_space, spaces.Discrete)
        return CategoricalHead([int(action_space.n)])
    if type(action_dist) is MultiCategoricalDistribution:
        return CategoricalHead([int(n) for n in action_dist.action_dims])
    if type(action_dist) is BernoulliDistribution:
        return BernoulliHead(int(action_dist.action_dims))
    if type(action_dist) is DiagGaussianDistribution:
        return DiagGaussianHead(int(action_dist.action_dim))
    return None
