"""
TRPO's natural-gradient pieces on the hand-derived MLP executor, without a double-backward graph (``docs/maths.md``,
"TRPO Fisher-vector product"):

- :class:`OutputFisher` and its three families: the KL divergence from the rollout's policy and its Hessian in the
  action net's output space (categorical logits ``diag(p) - p p^T`` per block, Bernoulli logits ``p (1 - p) / d``, the
  diagonal Gaussian's mean ``1 / (d sigma^2)`` and state-independent ``log_std`` ``2 / d``, ``d`` the action dimensions
  stock's ``.mean()`` averages over);
- :class:`FisherVectorProduct`: ``F v = J^T M J v / n + damping * v`` over the actor's flat parameter range, ``J v``
  by a forward tangent pass through the kept activations (:meth:`~sb3_speedups.common.nn.training.MlpChain.forward_tangent`),
  ``J^T`` by the executor's ordinary backward.

At the rollout's parameters this is exactly the Hessian of stock's ``kl_divergence(new, old).mean()`` (the term with
the KL's output gradient vanishes there), which stock computes with a second backward through autograd.
"""

from __future__ import annotations

import torch as th
import torch.nn.functional as F

from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp
from sb3_speedups.common.nn.heads import ActionHead, BernoulliHead, CategoricalHead, DiagGaussianHead


class OutputFisher:
    """The KL divergence from the old policy and its Hessian, as functions of the action net's output ``out``."""

    def set_old(self, out: th.Tensor, log_std: th.Tensor | None) -> None:
        """Keep the rollout policy's distribution (the output at the parameters the update starts from)."""
        raise NotImplementedError

    def kl(self, out: th.Tensor, log_std: th.Tensor | None) -> th.Tensor:
        """:return: stock's ``kl_divergence(new, old).mean()`` (0-dim) for the new output ``out``"""
        raise NotImplementedError

    def product_(self, u: th.Tensor) -> th.Tensor:
        """:return: ``u`` ``[n, n_out]`` (a tangent of ``out``) multiplied in place by the KL's Hessian at the old output"""
        raise NotImplementedError

    def log_std_product_(self, v: th.Tensor) -> None:
        """Multiply in place the ``log_std`` part of a direction by its (state-independent) Hessian block."""


class CategoricalFisher(OutputFisher):
    """
    ``Discrete`` / ``MultiDiscrete``: per block, the Hessian of ``KL(softmax(l) || p)`` in the logits at ``p`` is
    ``diag(p) - p p^T``, so ``M u = p * (u - <p, u>)``.

    :param nvec: choices per block
    """

    def __init__(self, nvec: list[int]) -> None:
        self.bounds = [(sum(nvec[:j]), sum(nvec[: j + 1])) for j in range(len(nvec))]
        self.logp_old: list[th.Tensor] = []
        self.p_old: list[th.Tensor] = []

    def _log_probs(self, out: th.Tensor) -> list[th.Tensor]:
        # as torch's Categorical: logits normalised by their logsumexp
        blocks = [out[:, start:end] for start, end in self.bounds]
        return [b - b.logsumexp(dim=-1, keepdim=True) for b in blocks]

    def set_old(self, out: th.Tensor, log_std: th.Tensor | None) -> None:
        self.logp_old = self._log_probs(out)
        self.p_old = [th.exp(lp) for lp in self.logp_old]

    def kl(self, out: th.Tensor, log_std: th.Tensor | None) -> th.Tensor:
        total = out.new_zeros(out.shape[0])
        for logp, logp_old in zip(self._log_probs(out), self.logp_old, strict=True):
            total += (th.exp(logp) * (logp - logp_old)).sum(dim=-1)
        return total.mean()

    def product_(self, u: th.Tensor) -> th.Tensor:
        for (start, end), p in zip(self.bounds, self.p_old, strict=True):
            block = u[:, start:end]
            block.sub_((p * block).sum(dim=-1, keepdim=True)).mul_(p)
        return u


class BernoulliFisher(OutputFisher):
    """
    ``MultiBinary``: independent Bernoulli logits, Hessian ``p (1 - p) / d`` per logit (SB3's ``kl_divergence`` keeps
    the ``d`` dimensions apart, so stock's ``.mean()`` averages over them too).
    """

    def set_old(self, out: th.Tensor, log_std: th.Tensor | None) -> None:
        self.logits_old = out.clone()
        p = th.sigmoid(out)
        self.weight = p * (1 - p) / out.shape[1]

    def kl(self, out: th.Tensor, log_std: th.Tensor | None) -> th.Tensor:
        # torch's kl_divergence(Bernoulli, Bernoulli), averaged over rows and dimensions as stock's .mean()
        p, q = out, self.logits_old
        probs = th.sigmoid(p)
        t1 = probs * (F.softplus(-q) - F.softplus(-p))
        t2 = (1 - probs) * (F.softplus(q) - F.softplus(p))
        return (t1 + t2).mean()

    def product_(self, u: th.Tensor) -> th.Tensor:
        return u.mul_(self.weight)


class GaussianFisher(OutputFisher):
    """
    ``Box`` without gSDE: for ``KL(N(mu, s) || N(mu_old, s_old))`` per dimension the Hessian at the old parameters is
    ``1 / s_old^2`` in the mean, ``2`` in ``log s`` and ``0`` across them; each divided by the ``d`` dimensions, which
    stock's ``.mean()`` averages over (SB3's ``kl_divergence`` keeps them apart).
    """

    def set_old(self, out: th.Tensor, log_std: th.Tensor | None) -> None:
        assert log_std is not None
        self.mean_old, self.log_std_old = out.clone(), log_std.clone()
        self.dims = out.shape[1]
        self.weight = th.exp(-2 * self.log_std_old) / self.dims

    def kl(self, out: th.Tensor, log_std: th.Tensor | None) -> th.Tensor:
        # torch's kl_divergence(Normal, Normal), std = exp(log_std) as SB3 builds it, averaged as stock's .mean()
        assert log_std is not None
        std, std_old = th.exp(log_std), th.exp(self.log_std_old)
        var_ratio = (std / std_old).pow(2)
        t1 = ((out - self.mean_old) / std_old).pow(2)
        return (0.5 * (var_ratio + t1 - 1 - var_ratio.log())).mean()

    def product_(self, u: th.Tensor) -> th.Tensor:
        return u.mul_(self.weight)

    def log_std_product_(self, v: th.Tensor) -> None:
        v.mul_(2.0 / self.dims)


def make_output_fisher(head: ActionHead) -> OutputFisher | None:
    """:return: the KL and Fisher of ``head``'s distribution family, or ``None`` where there is none by hand"""
    if isinstance(head, CategoricalHead):
        return CategoricalFisher(head.nvec)
    if isinstance(head, BernoulliHead):
        return BernoulliFisher()
    if isinstance(head, DiagGaussianHead):
        return GaussianFisher()
    return None


class FisherVectorProduct:
    """
    Products with the damped Fisher matrix of the actor at the parameters of the last ``net.forward_part(x, 0)``.

    The direction is written into the actor's range of the flat gradient buffer, so that the executor's gradient
    views are the direction's views for the tangent pass; the backward then overwrites that range with the product.

    :param net: the split executor (part 0: the actor); its last actor forward is the linearisation point
    :param fisher: the output-space KL Hessian, its old distribution set at that point
    :param actor: the actor's range of the flat buffers
    :param damping: stock's ``cg_damping``
    :param n: the row count of that forward
    """

    def __init__(self, net: ActorCriticMlp, fisher: OutputFisher, actor: slice, damping: float, n: int) -> None:
        self.net, self.fisher, self.actor, self.damping, self.n = net, fisher, actor, damping, n

    def __call__(self, v: th.Tensor) -> th.Tensor:
        """
        :param v: a direction over the actor's parameters (stock's order: the actor's flat range)
        :return: ``F v + damping * v`` (a new tensor: stock's conjugate gradient keeps it while it asks for the next)
        """
        net, grad = self.net, self.net.flat.grad[self.actor]
        grad.copy_(v)
        n, latent = self.n, net.latents[0]
        assert latent is not None, "Fisher-vector product before the actor's forward"
        # tangent of the action net's output: dW_a h + db_a + W_a t
        u = th.addmm(net.grad_head_biases[0], latent, net.grad_head_weights[0].t(), out=net.d_out_buffer(n))
        tangent = net.chains[0].forward_tangent(n)
        if tangent is not None:
            u.addmm_(tangent[0], net.head_weights_t[0])
        self.fisher.product_(u).div_(n)
        if net.grad_log_std is not None:
            self.fisher.log_std_product_(net.grad_log_std)
        net.backward_part(u, 0)
        return grad + self.damping * v
