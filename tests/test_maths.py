"""The hand-derived gradients of docs/maths.md, each against autograd on small random inputs."""

import copy

import pytest
import torch as th
import torch.nn.functional as F
from gymnasium import spaces
from stable_baselines3.common.distributions import (
    BernoulliDistribution,
    CategoricalDistribution,
    DiagGaussianDistribution,
    MultiCategoricalDistribution,
)
from stable_baselines3.dqn.policies import DQNPolicy

from sb3_speedups.common.nn.heads import BernoulliHead, CategoricalHead, DiagGaussianHead
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.dqn.update import HandDerivedQUpdate, huber_
from sb3_speedups.qrdqn.head import QuantileHead

N = 29  # rows of a minibatch

HEADS = {
    "discrete": (lambda: CategoricalHead([4]), lambda: CategoricalDistribution(4)),
    "multidiscrete_equal": (lambda: CategoricalHead([3, 3]), lambda: MultiCategoricalDistribution([3, 3])),
    "multidiscrete_unequal": (lambda: CategoricalHead([3, 2, 4]), lambda: MultiCategoricalDistribution([3, 2, 4])),
    "multibinary": (lambda: BernoulliHead(3), lambda: BernoulliDistribution(3)),
    "box": (lambda: DiagGaussianHead(2), lambda: DiagGaussianDistribution(2)),
}


def random_actions(head, gen):
    """:return: actions as the rollout buffer stores them (float ``[N, action_dim]``)"""
    if isinstance(head, CategoricalHead):
        return th.stack([th.randint(0, m, (N,), generator=gen) for m in head.nvec], dim=1).float()
    if isinstance(head, BernoulliHead):
        return th.randint(0, 2, (N, head.n_outputs), generator=gen).float()
    return th.randn(N, head.n_outputs, generator=gen)


def sb3_log_prob_entropy(dist, out, actions, log_std):
    """:return: SB3's ``log_prob(actions)`` and ``entropy()`` of the distribution over ``out``"""
    if isinstance(dist, DiagGaussianDistribution):
        dist.proba_distribution(out, log_std)
        return dist.log_prob(actions), dist.entropy()
    dist.proba_distribution(out)
    if isinstance(dist, CategoricalDistribution):
        actions = actions.long().view(-1)
    return dist.log_prob(actions), dist.entropy()


@pytest.mark.parametrize("name", HEADS)
@pytest.mark.parametrize("entropy_grad", [0.0, -0.3])
def test_head_gradients_equal_autograd(name, entropy_grad):
    # d/d logits (and d/d log_std) of sum(g * log p(a)) + c * sum(H): hand-derived against autograd through SB3's
    # distribution objects, and through the head's own differentiable log_prob_entropy (the autograd update's path)
    make, make_dist = HEADS[name]
    head, gen = make(), th.Generator().manual_seed(1)
    out = th.randn(N, head.n_outputs, generator=gen) * 2.0
    log_std = th.randn(head.n_outputs, generator=gen) * 0.5 if head.has_log_std else None
    actions, g_log_prob = random_actions(head, gen), th.randn(N, generator=gen)

    ws = head.workspace(N, th.device("cpu"))
    log_prob, neg_entropy = th.empty(N), th.empty(N)
    d_out, d_log_std = th.empty_like(out), th.empty_like(log_std) if log_std is not None else None
    for _ in range(2):  # the second pass reuses the views the first one made
        head.forward(ws, out, head.training_actions(actions), log_std, log_prob, neg_entropy)
        head.backward(ws, g_log_prob, entropy_grad, d_out, d_log_std)

    for reference in (
        lambda o, s: sb3_log_prob_entropy(make_dist(), o, actions, s),
        lambda o, s: head.log_prob_entropy(o, actions, s),
    ):
        leaf_out = out.clone().requires_grad_()
        leaf_log_std = None if log_std is None else log_std.clone().requires_grad_()
        ref_log_prob, ref_entropy = reference(leaf_out, leaf_log_std)
        th.testing.assert_close(log_prob, ref_log_prob.detach())
        th.testing.assert_close(-neg_entropy, ref_entropy.detach())
        objective = (g_log_prob * ref_log_prob).sum() + entropy_grad * ref_entropy.sum()
        leaves = [leaf_out] if leaf_log_std is None else [leaf_out, leaf_log_std]
        grads = th.autograd.grad(objective, leaves)
        th.testing.assert_close(d_out, grads[0], rtol=1e-5, atol=1e-6)
        if leaf_log_std is not None:
            th.testing.assert_close(d_log_std, grads[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("net_arch, activation", [([16, 16], th.nn.ReLU), ([8], th.nn.Tanh), ([], th.nn.ReLU)])
def test_dqn_huber_gradient_equals_autograd(weighted, net_arch, activation):
    # the gradient HandDerivedQUpdate.step writes (no clipping: a huge max norm) against autograd of stock's Huber loss
    # (and of huber_, the importance-weighted one), for TD errors on both sides of |d| = 1
    th.manual_seed(0)
    obs_space, action_space = spaces.Box(-1, 1, (5,)), spaces.Discrete(3)
    policy = DQNPolicy(obs_space, action_space, lambda _: 1e-3, net_arch=net_arch, activation_fn=activation)
    stock = copy.deepcopy(policy)
    update = HandDerivedQUpdate(policy)
    gen = th.Generator().manual_seed(2)
    obs, actions = th.randn(N, 5, generator=gen), th.randint(0, 3, (N, 1), generator=gen)
    target = th.randn(N, 1, generator=gen) * 2.0
    weights = th.rand(N, 1, generator=gen) if weighted else None

    td = update.step(obs, actions, target, weights, max_grad_norm=1e9)

    q = th.gather(stock.q_net(obs), 1, actions)
    assert ((q - target).abs() > 1).any() and ((q - target).abs() < 1).any()
    loss = F.smooth_l1_loss(q, target) if weights is None else huber_(q - target, weights)
    grads = th.autograd.grad(loss, list(stock.q_net.parameters()))
    for p, g in zip(policy.q_net.parameters(), grads, strict=True):
        th.testing.assert_close(update.flat.grad_of(p), g, rtol=1e-5, atol=1e-7)
    th.testing.assert_close(td, (q - target).detach())


@pytest.mark.parametrize("net_arch, activation", [([16, 16], th.nn.ReLU), ([8], th.nn.Tanh), ([], th.nn.ReLU)])
def test_quantile_huber_gradient_equals_autograd(net_arch, activation):
    # the gradient HandDerivedQUpdate.step writes with QR-DQN's head (no clipping) against autograd of sb3-contrib's
    # quantile_huber_loss, for pairwise errors on both sides of |delta| = 1 and of 0
    from sb3_contrib.common.utils import quantile_huber_loss
    from sb3_contrib.qrdqn.policies import QRDQNPolicy

    th.manual_seed(0)
    n_quantiles, obs_space, action_space = 7, spaces.Box(-1, 1, (5,)), spaces.Discrete(3)
    policy = QRDQNPolicy(
        obs_space, action_space, lambda _: 1e-3, n_quantiles=n_quantiles, net_arch=net_arch, activation_fn=activation
    )
    stock = copy.deepcopy(policy)
    update = HandDerivedQUpdate(policy, QuantileHead(n_quantiles, 3))
    gen = th.Generator().manual_seed(2)
    obs, actions = th.randn(N, 5, generator=gen), th.randint(0, 3, (N, 1), generator=gen)
    target = th.randn(N, n_quantiles, generator=gen) * 2.0

    step_loss = update.step(obs, actions, target, None, max_grad_norm=None)

    index = actions[..., None].expand(N, n_quantiles, 1)
    expected = th.gather(stock.quantile_net(obs), dim=2, index=index).squeeze(dim=2)
    delta = target.unsqueeze(1) - expected.unsqueeze(2)
    assert (delta.abs() > 1).any() and (delta.abs() < 1).any() and (delta < 0).any() and (delta > 0).any()
    loss = quantile_huber_loss(expected, target, sum_over_quantiles=True)
    grads = th.autograd.grad(loss, list(stock.quantile_net.parameters()))
    for p, g in zip(policy.quantile_net.parameters(), grads, strict=True):
        th.testing.assert_close(update.flat.grad_of(p), g, rtol=1e-5, atol=1e-7)
    th.testing.assert_close(step_loss, loss.detach())  # the logged loss, by its own formula: float32 rounding


@pytest.mark.parametrize("max_norm", [0.1, 1e3])
def test_clip_divisor_clips_as_clip_grad_norm(max_norm):
    # dividing by clip_divisor (what FlatAdam does inside its kernel) against torch.nn.utils.clip_grad_norm_
    th.manual_seed(0)
    params = [th.nn.Parameter(th.randn(shape)) for shape in ((7, 3), (3,), (5,))]
    flat = FlatParameters(params)
    flat.grad.copy_(th.randn(flat.grad.shape))
    for p in params:
        p.grad = flat.grad_of(p).clone()
    th.nn.utils.clip_grad_norm_(params, max_norm)
    divisor = flat.clip_divisor(max_norm)
    assert (divisor is None) == (max_norm == 1e3)
    clipped = flat.grad if divisor is None else flat.grad / divisor
    for p in params:
        th.testing.assert_close(clipped[flat.offset(p) : flat.offset(p) + p.numel()].view_as(p), p.grad)


@pytest.mark.parametrize("n_critics, n_quantiles, dropped", [(2, 5, 1), (3, 4, 0), (1, 6, 2)])
def test_tqc_quantile_huber_gradient_equals_autograd(n_critics, n_quantiles, dropped):
    # the gradient TruncatedQuantileLoss.critic_step writes (before its Adam step) and the loss it logs, against autograd
    # of sb3-contrib's quantile_huber_loss(sum_over_quantiles=False) on TQC's critic, pairwise errors on both sides of
    # 0 and of +-1
    from sb3_contrib.common.utils import quantile_huber_loss
    from sb3_contrib.tqc.policies import TQCPolicy

    from sb3_speedups.common.off_policy.critics import StackedCritics
    from sb3_speedups.tqc.quantile_loss import TruncatedQuantileLoss

    th.manual_seed(0)
    obs_space, action_space = spaces.Box(-1, 1, (3,)), spaces.Box(-1, 1, (2,))
    policy = TQCPolicy(obs_space, action_space, lambda _: 1e-3, net_arch=[16, 8], n_quantiles=n_quantiles, n_critics=n_critics)
    stock = copy.deepcopy(policy.critic)
    loss_of = TruncatedQuantileLoss(n_critics, n_quantiles, dropped)
    critics = StackedCritics(policy.critic, policy.critic_target, policy.critic.optimizer, loss_of.critic_class)
    critics.adam.step = lambda: None  # the gradient before the step
    gen = th.Generator().manual_seed(2)
    obs, actions = th.randn(N, 3, generator=gen), th.rand(N, 2, generator=gen) * 2 - 1
    target = th.sort(th.randn(N, loss_of.n_target_quantiles, generator=gen) * 1.5, dim=1).values

    loss = loss_of.critic_step(critics, th.cat([obs, actions], dim=1), target)

    current = stock(obs, actions)
    delta = target[:, None, None, :] - current.unsqueeze(-1)
    assert (delta.abs() > 1).any() and (delta.abs() < 1).any() and (delta < 0).any() and (delta > 0).any()
    expected = quantile_huber_loss(current, target.unsqueeze(1), sum_over_quantiles=False)
    grads = th.autograd.grad(expected, list(stock.parameters()))
    for p, g in zip(policy.critic.parameters(), grads, strict=True):
        th.testing.assert_close(critics.flat.grad_of(p), g, rtol=1e-5, atol=1e-7)
    th.testing.assert_close(loss, expected.detach())
