"""``MultiBinary`` actions: an independent Bernoulli per dimension (``docs/maths.md``, "Bernoulli")."""

from __future__ import annotations

from dataclasses import dataclass

import torch as th
import torch.nn.functional as F

from sb3_speedups.common.nn.heads.base import ActionHead, HeadWorkspace, column_of


@dataclass(slots=True, kw_only=True)
class BernoulliWorkspace(HeadWorkspace):
    """
    :param sigma: ``sigmoid(logits)`` ``[n, n_outputs]``
    :param tmp: scratch of the same shape
    :param out: the logits of the last forward
    :param actions: the actions of the last forward
    """

    sigma: th.Tensor
    tmp: th.Tensor
    out: th.Tensor | None = None
    actions: th.Tensor | None = None


class BernoulliHead(ActionHead[BernoulliWorkspace]):
    """``MultiBinary``: independent Bernoulli per dimension (log-probs and entropies summed)."""

    def sample(self, out: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        actions = th.bernoulli(th.sigmoid(out))
        return actions, -F.binary_cross_entropy_with_logits(out, actions, reduction="none").sum(dim=1)

    def log_prob_entropy(self, out: th.Tensor, actions: th.Tensor, log_std: th.Tensor | None) -> tuple[th.Tensor, th.Tensor]:
        log_prob = -F.binary_cross_entropy_with_logits(out, actions, reduction="none").sum(dim=1)
        entropy = F.binary_cross_entropy_with_logits(out, th.sigmoid(out), reduction="none").sum(dim=1)
        return log_prob, entropy

    def workspace(self, n: int, device: th.device) -> BernoulliWorkspace:
        return BernoulliWorkspace(
            sigma=th.empty(n, self.n_outputs, device=device), tmp=th.empty(n, self.n_outputs, device=device)
        )

    def forward(
        self,
        ws: BernoulliWorkspace,
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        # log p(a) = a * l - softplus(l) ;  H = softplus(l) - l * sigmoid(l)
        sigma, tmp = ws.sigma, ws.tmp
        ws.out, ws.actions = out, actions["actions"]
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
        ws: BernoulliWorkspace,
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        # d log p / d l = a - sigmoid(l) ;  d H / d l = -l * sigmoid(l) * (1 - sigmoid(l))
        sigma, tmp, out, actions = ws.sigma, ws.tmp, ws.out, ws.actions
        assert out is not None and actions is not None, "backward needs a forward first"
        th.sub(actions, sigma, out=d_out)
        d_out.mul_(column_of(ws, g_log_prob))
        if entropy_grad != 0.0:
            th.mul(sigma, sigma, out=tmp)
            tmp.neg_().add_(sigma).mul_(out)  # sigma * (1 - sigma) * l
            d_out.sub_(tmp, alpha=entropy_grad)
