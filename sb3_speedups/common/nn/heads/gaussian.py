"""``Box`` actions without gSDE: a diagonal Gaussian, state-independent ``log_std`` (``docs/maths.md``, "Gaussian")."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch as th

from sb3_speedups.common.nn.heads.base import ActionHead, HeadWorkspace, column_of

_LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


@dataclass(slots=True, kw_only=True)
class GaussianWorkspace(HeadWorkspace):
    """
    :param z: standardised actions ``(a - mu) / std`` ``[n, n_outputs]``
    :param z2: their squares
    :param inv_std: ``exp(-log_std)`` of the last forward
    """

    z: th.Tensor
    z2: th.Tensor
    inv_std: th.Tensor | None = None


class DiagGaussianHead(ActionHead[GaussianWorkspace]):
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

    def workspace(self, n: int, device: th.device) -> GaussianWorkspace:
        return GaussianWorkspace(z=th.empty(n, self.n_outputs, device=device), z2=th.empty(n, self.n_outputs, device=device))

    def forward(
        self,
        ws: GaussianWorkspace,
        out: th.Tensor,
        actions: dict[str, th.Tensor],
        log_std: th.Tensor | None,
        log_prob: th.Tensor,
        neg_entropy: th.Tensor,
    ) -> None:
        assert log_std is not None
        z, z2 = ws.z, ws.z2
        inv_std = th.exp(-log_std)
        th.sub(actions["actions"], out, out=z)
        z.mul_(inv_std)  # z = (a - mu) / std
        th.mul(z, z, out=z2)
        th.sum(z2, 1, out=log_prob)
        constant = log_std.sum() + self.n_outputs * _LOG_SQRT_2PI
        log_prob.mul_(-0.5).sub_(constant)
        # The entropy does not depend on the state: sum(0.5 + log sqrt(2 pi) + log_std).
        neg_entropy.copy_((-(constant + 0.5 * self.n_outputs)).expand_as(neg_entropy))
        ws.inv_std = inv_std

    def backward(
        self,
        ws: GaussianWorkspace,
        g_log_prob: th.Tensor,
        entropy_grad: float,
        d_out: th.Tensor,
        d_log_std: th.Tensor | None,
    ) -> None:
        # d log p / d mu = z / std ;  d log p / d log_std = z^2 - 1 ;  d H / d log_std = 1 (per sample)
        assert d_log_std is not None and ws.inv_std is not None
        z, z2 = ws.z, ws.z2
        th.mul(z, ws.inv_std, out=d_out)
        d_out.mul_(column_of(ws, g_log_prob))
        th.mv(z2.t(), g_log_prob, out=d_log_std)
        d_log_std.sub_(g_log_prob.sum() - entropy_grad * g_log_prob.shape[0])
