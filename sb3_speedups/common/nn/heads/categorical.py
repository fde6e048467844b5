"""``Discrete`` and ``MultiDiscrete`` actions: one categorical distribution per block (``docs/maths.md``, "Categorical")."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch as th
import torch.nn.functional as F

from sb3_speedups.common.nn.heads.base import ActionHead, HeadWorkspace, column_of, sample_one_per_row


@dataclass(slots=True)
class UniformBlocks:
    """``[n, k, m]`` views of ``[n, k * m]`` buffers whose ``k`` blocks all have ``m`` choices."""

    out: th.Tensor
    logp_all: th.Tensor
    tmp: th.Tensor


@dataclass(slots=True)
class CategoricalViews:
    """
    Views of the tensors one :meth:`CategoricalHead.forward` wrote, made once while the same tensors come back.

    :param out: the action net's output they were made for
    :param log_prob: the log-probability output they were made for
    :param neg_entropy: the negated-entropy output they were made for
    :param picked: each block's log-probability of the taken action (``log_prob`` itself for one block)
    :param block_neg_entropy: each block's ``sum(p * log p)`` (``neg_entropy`` itself for one block)
    :param blocks: the block views of equal blocks, else ``None``
    """

    out: th.Tensor
    log_prob: th.Tensor
    neg_entropy: th.Tensor
    picked: th.Tensor
    block_neg_entropy: th.Tensor
    blocks: UniformBlocks | None


@dataclass(slots=True, kw_only=True)
class CategoricalWorkspace(HeadWorkspace):
    """
    :param logp_all: log-probabilities of every choice ``[n, n_outputs]``
    :param p: probabilities of every choice
    :param tmp: scratch of the same shape
    :param picked: per-block log-probabilities of the taken actions (used with several blocks)
    :param picked_neg_entropy: per-block ``sum(p * log p)`` (used with several blocks)
    :param onehot: the taken actions one-hot ``[n, n_outputs]``, from the last forward
    :param views: views of the last forward's tensors
    """

    logp_all: th.Tensor
    p: th.Tensor
    tmp: th.Tensor
    picked: th.Tensor
    picked_neg_entropy: th.Tensor
    onehot: th.Tensor | None = None
    views: CategoricalViews | None = None


@dataclass(slots=True)
class RaceBuffers:
    """:meth:`CategoricalHead.sample_numpy`'s kept buffers: the exponential draws (tensor and numpy view), row indices."""

    draws: th.Tensor
    draws_numpy: np.ndarray
    rows: np.ndarray


class CategoricalHead(ActionHead[CategoricalWorkspace]):
    """
    ``Discrete`` (one block) and ``MultiDiscrete`` (one categorical per block, log-probs and entropies summed).

    :param nvec: number of choices of each block
    """

    def __init__(self, nvec: list[int]) -> None:
        super().__init__(sum(nvec))
        self.nvec = nvec
        self.discrete = len(nvec) == 1
        self._race: RaceBuffers | None = None
        self._starts: dict[th.device, th.Tensor] = {}
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
        # (the ufuncs' reduce, not the array methods: the same results without the methods' Python wrappers)
        shifted = np.subtract(out, np.maximum.reduce(out, axis=1, keepdims=True))
        exp = np.exp(shifted)
        total = np.add.reduce(exp, axis=1, keepdims=True)
        race = self._race_buffers(out.shape)
        race.draws.exponential_()
        np.divide(exp, total, out=exp)
        actions = np.divide(exp, race.draws_numpy, out=exp).argmax(axis=1)
        # the chosen entries of shifted - log(total): the same float operations as on the whole array
        log_prob = shifted[race.rows, actions] - np.log(total[:, 0])
        return actions, th.from_numpy(log_prob)

    def _race_buffers(self, shape: tuple[int, ...]) -> RaceBuffers:
        """:return: a kept float32 tensor of ``shape`` for the exponential draws, its numpy view, and the row indices"""
        race = self._race
        if race is None or race.draws_numpy.shape != shape:
            with th.inference_mode(False):
                q = th.empty(shape, dtype=th.float32)
            race = self._race = RaceBuffers(q, q.numpy(), np.arange(shape[0]))
        return race

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
        onehot = th.zeros(actions.shape[0], self.n_outputs, dtype=actions.dtype, device=actions.device)
        onehot.scatter_(1, index if self.discrete else index + self._block_starts(actions.device), 1.0)
        return {"index": index.unsqueeze(-1) if self.uniform else index, "onehot": onehot}

    def _block_starts(self, device: th.device) -> th.Tensor:
        """:return: each block's first column in the output ``[n_blocks]``, made once per device (A2C asks every update)"""
        starts = self._starts.get(device)
        if starts is None:
            with th.inference_mode(False):
                starts = self._starts[device] = th.tensor([start for start, _ in self.bounds], device=device)
        return starts

    def workspace(self, n: int, device: th.device) -> CategoricalWorkspace:
        shape = (n, len(self.nvec), 1) if self.uniform else (n, len(self.nvec))
        return CategoricalWorkspace(
            logp_all=th.empty(n, self.n_outputs, device=device),
            p=th.empty(n, self.n_outputs, device=device),
            tmp=th.empty(n, self.n_outputs, device=device),
            picked=th.empty(shape, device=device),
            picked_neg_entropy=th.empty(shape, device=device),
        )

    def _views(
        self, ws: CategoricalWorkspace, out: th.Tensor, log_prob: th.Tensor, neg_entropy: th.Tensor
    ) -> CategoricalViews:
        """:return: the views of these tensors, made once: the buffers are reused from one minibatch to the next"""
        views = ws.views
        if views is None or views.out is not out or views.log_prob is not log_prob or views.neg_entropy is not neg_entropy:
            # One block: write straight into the outputs; several: per-block values, then their sum.
            n = out.shape[0]
            picked = log_prob.view(n, 1, 1) if self.discrete else ws.picked
            block_neg_entropy = neg_entropy.view(n, 1, 1) if self.discrete else ws.picked_neg_entropy
            blocks = None
            if self.uniform:
                blocks = UniformBlocks(self._blocks(out)[0], self._blocks(ws.logp_all)[0], self._blocks(ws.tmp)[0])
            views = ws.views = CategoricalViews(out, log_prob, neg_entropy, picked, block_neg_entropy, blocks)
        return views

    def forward(
        self,
        ws: CategoricalWorkspace,
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        logp_all, p, tmp = ws.logp_all, ws.p, ws.tmp
        n, index = out.shape[0], actions["index"]
        ws.onehot = actions["onehot"]
        views = self._views(ws, out, log_prob, neg_entropy)
        picked, block_neg_ent, blocks = views.picked, views.block_neg_entropy, views.blocks
        if blocks is not None:
            th.log_softmax(blocks.out, 2, out=blocks.logp_all)
            th.gather(blocks.logp_all, 2, index, out=picked)
        else:
            for j, (start, end) in enumerate(self.bounds):
                th.log_softmax(out[:, start:end], 1, out=logp_all[:, start:end])
                th.gather(logp_all[:, start:end], 1, index[:, j : j + 1], out=picked[:, j : j + 1])
        self._exp(ws, logp_all, p)
        th.mul(p, logp_all, out=tmp)
        # Per-block sum(p * log p) (the negated block entropy) is needed by the entropy gradient.
        if blocks is not None:
            th.sum(blocks.tmp, 2, keepdim=True, out=block_neg_ent)
        else:
            for j, (start, end) in enumerate(self.bounds):
                th.sum(tmp[:, start:end], 1, keepdim=True, out=block_neg_ent[:, j : j + 1])
        if not self.discrete:
            th.sum(picked.view(n, -1), 1, out=log_prob)
            th.sum(block_neg_ent.view(n, -1), 1, out=neg_entropy)

    def _exp(self, ws: CategoricalWorkspace, logp_all: th.Tensor, p: th.Tensor) -> None:
        """Write the probabilities ``exp(logp_all)`` into ``p``."""
        th.exp(logp_all, out=p)

    def backward(
        self,
        ws: CategoricalWorkspace,
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        # d log p(a) / d logits = onehot(a) - p ;  d H / d logits = -p * (log p + H)   (per block)
        logp_all, p, tmp, onehot, views = ws.logp_all, ws.p, ws.tmp, ws.onehot, ws.views
        assert onehot is not None and views is not None, "backward needs a forward first"
        th.sub(onehot, p, out=d_out)
        d_out.mul_(column_of(ws, g_log_prob))
        if entropy_grad != 0.0:
            block_neg_ent = views.block_neg_entropy
            for j, (tmp_block, logp_block) in enumerate(zip(self._blocks(tmp), self._blocks(logp_all), strict=True)):
                th.sub(logp_block, block_neg_ent if self.uniform else block_neg_ent[:, j : j + 1], out=tmp_block)
            tmp.mul_(p)
            d_out.sub_(tmp, alpha=entropy_grad)
