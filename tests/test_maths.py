"""The hand-derived gradients of docs/maths.md, each against autograd on small random inputs."""

import copy
from types import SimpleNamespace

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
from sb3_contrib import TRPO
from stable_baselines3.common.distributions import kl_divergence
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.dqn.policies import DQNPolicy

from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp
from sb3_speedups.common.nn.heads import BernoulliHead, CategoricalHead, DiagGaussianHead, make_head
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.dqn.update import HandDerivedQUpdate, huber_
from sb3_speedups.qrdqn.head import QuantileHead
from sb3_speedups.trpo.natural_gradient import FisherVectorProduct, make_output_fisher

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


@pytest.mark.parametrize("renorm", [False, True], ids=["warmup", "renorm"])
@pytest.mark.parametrize("affine", [True, False])
def test_crossq_batch_renorm_gradient_equals_autograd(renorm, affine):
    # BatchRenormTraining's backward (input, scale and bias gradients) against autograd through sb3-contrib's
    # BatchRenorm1d in training mode, in float64 (the variance summed in another order is rounding only); after warm-up
    # with running statistics that clamp some corrections r and d and leave others inside their bounds
    from sb3_contrib.common.torch_layers import BatchRenorm1d

    from sb3_speedups.crossq.batch_renorm import RenormCounts, batch_renorm

    gen = th.Generator().manual_seed(0)
    stock = BatchRenorm1d(6, affine=affine, warmup_steps=3).double()
    with th.no_grad():
        stock.steps.fill_(4 if renorm else 0)
        stock.ra_mean.copy_(th.tensor([0.0, 1.0, -1.0, 20.0, 0.5, 0.0]))
        stock.ra_var.copy_(th.tensor([1.0, 0.04, 4.0, 1.0, 100.0, 1.0]))
        stock.scale.uniform_(0.5, 1.5, generator=gen)
        stock.bias.normal_(generator=gen)
    ours = copy.deepcopy(stock)
    x = (th.randn(N, 6, generator=gen, dtype=th.float64) * 2 + 0.5).requires_grad_(True)
    upstream = th.randn(N, 6, generator=gen, dtype=th.float64)
    n = 3 if affine else 1  # x, and the affine layer's scale and bias
    expected = th.autograd.grad((stock(x) * upstream).sum(), [x, stock.scale, stock.bias][:n])
    got = th.autograd.grad((batch_renorm(ours, x, True, RenormCounts(ours)) * upstream).sum(), [x, ours.scale, ours.bias][:n])
    for g, e in zip(got, expected, strict=True):
        th.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("out_features", [1, 7], ids=["one-unit", "layer"])
@pytest.mark.parametrize("renorm", [False, True], ids=["warmup", "renorm"])
def test_crossq_norm_through_next_layer_equals_autograd(renorm, out_features):
    # StackedRenorm.backward_linear (docs/maths.md, "Through the next layer"): two stacked BatchRenorm1d layers, each
    # feeding its own Linear layer, with the norm's column sums taken from that layer's gradients; the norm's input,
    # scale and bias gradients and the layer's weight gradient against autograd, float64. A one-unit layer (the
    # critics' output) forms the output's gradient as an outer product inside the first pass; a wider one takes it given.
    from sb3_contrib.common.torch_layers import BatchRenorm1d

    from sb3_speedups.common.nn.flat import FlatParameters
    from sb3_speedups.crossq.batch_renorm import RenormCounts
    from sb3_speedups.crossq.stacked_renorm import StackedRenorm

    gen = th.Generator().manual_seed(1)
    layers = [BatchRenorm1d(9, warmup_steps=3).double() for _ in range(2)]
    with th.no_grad():
        for m in layers:
            m.steps.fill_(4 if renorm else 0)
            m.ra_mean.normal_(generator=gen)
            m.ra_var.uniform_(0.3, 3.0, generator=gen)
            m.scale.uniform_(0.5, 1.5, generator=gen)
            m.bias.normal_(generator=gen)
    stock = copy.deepcopy(layers)
    flat = FlatParameters([p for m in layers for p in m.parameters()], [m.scale for m in layers] + [m.bias for m in layers])
    norm = StackedRenorm(layers, flat)
    norm.counts = RenormCounts(*layers)
    x = th.randn(2, 2 * N, 9, generator=gen, dtype=th.float64) * 2 + 0.5
    weight = th.randn(2, out_features, 9, generator=gen, dtype=th.float64).requires_grad_(True)
    upstream = th.randn(2, 2 * N, out_features, generator=gen, dtype=th.float64)
    upstream[:, N:] = 0.0
    norm.forward(x)
    centred = norm.centred()
    assert centred is not None
    grad_weight, grad_bias = th.bmm(upstream.mT, centred), upstream.sum(1)
    grad_y = None if out_features == 1 else th.bmm(upstream, weight.detach())
    got_x = norm.backward_linear(upstream, weight.detach(), grad_weight, grad_bias, grad_y)
    x_ref = x.clone().requires_grad_(True)
    y = th.stack([m.train()(x_ref[g]) for g, m in enumerate(stock)])
    params = [x_ref, weight, *(m.scale for m in stock), *(m.bias for m in stock)]
    expected = th.autograd.grad((th.bmm(y, weight.mT) * upstream).sum(), params)
    th.testing.assert_close(got_x, expected[0], rtol=1e-10, atol=1e-12)
    th.testing.assert_close(grad_weight, expected[1], rtol=1e-10, atol=1e-12)
    for g, m in enumerate(layers):
        th.testing.assert_close(flat.grad_of(m.scale), expected[2 + g], rtol=1e-10, atol=1e-12)
        th.testing.assert_close(flat.grad_of(m.bias), expected[4 + g], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("renorm", [False, True], ids=["warmup", "renorm"])
def test_crossq_chain_with_norms_equals_autograd(renorm):
    # MlpChain with StackedRenorm input and output norms (CrossQ's critics: BatchRenorm1d before each Linear layer and
    # at the end) against autograd through the modules, float64: in training mode every parameter's gradient for an
    # upstream gradient that is zero on the second half of the rows (the critic loss of the joint forward), in
    # evaluation mode the input columns' gradient (the actor loss through the critics)
    from sb3_contrib.common.torch_layers import BatchRenorm1d

    from sb3_speedups.common.nn.flat import FlatParameters
    from sb3_speedups.common.nn.training import MlpChain
    from sb3_speedups.crossq.batch_renorm import RenormCounts
    from sb3_speedups.crossq.stacked_renorm import StackedRenorm
    from sb3_speedups.crossq.critics import parse_renorm_mlp, use_norms

    gen = th.Generator().manual_seed(0)
    nets = []
    for _ in range(2):
        net = th.nn.Sequential(
            BatchRenorm1d(5, warmup_steps=3),
            th.nn.Linear(5, 12),
            th.nn.ReLU(),
            BatchRenorm1d(12, warmup_steps=3),
            th.nn.Linear(12, 9),
            th.nn.ReLU(),
            BatchRenorm1d(9, warmup_steps=3),
        ).double()
        with th.no_grad():
            for m in net:
                if isinstance(m, BatchRenorm1d):
                    m.steps.fill_(4 if renorm else 0)
                    m.ra_mean.normal_(generator=gen)
                    m.ra_var.uniform_(0.3, 3.0, generator=gen)
                    m.scale.uniform_(0.5, 1.5, generator=gen)
                    m.bias.normal_(generator=gen)
        nets.append(net)
    stock = copy.deepcopy(nets)
    parsed = [parse_renorm_mlp(net) for net in nets]
    layout = []
    for k in range(3):
        norms = [found[1][k] for found in parsed]
        layout += [m.scale for m in norms] + [m.bias for m in norms]
        if k < 2:
            layout += [found[0].layers[k].weight for found in parsed] + [found[0].layers[k].bias for found in parsed]
    flat = FlatParameters([p for net in nets for p in net.parameters()], layout)
    norms = [StackedRenorm([found[1][k] for found in parsed], flat) for k in range(3)]
    chain = MlpChain(flat, [found[0] for found in parsed], norms)
    counts = RenormCounts(*nets)
    for norm in norms:
        norm.counts = counts
    x = th.randn(2 * N, 5, generator=gen, dtype=th.float64) * 2 + 0.5
    upstream = th.randn(2, 2 * N, 9, generator=gen, dtype=th.float64)
    upstream[:, N:] = 0.0
    out = chain.forward(x)
    expected_out = th.stack([net.train()(x) for net in stock])
    th.testing.assert_close(out, expected_out, rtol=1e-10, atol=1e-12)
    chain.backward(upstream.clone())
    loss = (expected_out * upstream).sum()
    for net, ours in zip(stock, nets, strict=True):
        grads = th.autograd.grad(loss, list(net.parameters()), retain_graph=True)
        for p, g in zip(ours.parameters(), grads, strict=True):
            th.testing.assert_close(flat.grad_of(p), g, rtol=1e-10, atol=1e-12)
    for net, ours in zip(stock, nets, strict=True):  # the running statistics moved as the modules moved theirs
        for (name, a), b in zip(ours.state_dict().items(), net.state_dict().values(), strict=True):
            th.testing.assert_close(a, b, rtol=1e-10, atol=0, msg=name)
    use_norms(norms, False)
    x_eval = (th.randn(N, 5, generator=gen, dtype=th.float64)).requires_grad_(True)
    upstream = th.randn(2, N, 9, generator=gen, dtype=th.float64)
    th.testing.assert_close(chain.forward(x_eval.detach()), th.stack([net.eval()(x_eval) for net in stock]).detach())
    got = chain.backward_input(upstream.clone(), slice(2, None)).sum(0)
    (expected,) = th.autograd.grad((th.stack([net(x_eval) for net in stock]) * upstream).sum(), [x_eval])
    th.testing.assert_close(got, expected[:, 2:], rtol=1e-10, atol=1e-12)


TRPO_ACTION_SPACES = {
    "discrete": spaces.Discrete(4),
    "multidiscrete": spaces.MultiDiscrete([3, 2, 4]),
    "multibinary": spaces.MultiBinary(3),
    "box": spaces.Box(-1.0, 1.0, (2,)),
}


@pytest.mark.parametrize("action_space", TRPO_ACTION_SPACES)
@pytest.mark.parametrize(
    "observation_space, net_arch, activation",
    [
        (spaces.Box(-2.0, 2.0, (5,)), [16, 16], th.nn.Tanh),
        (spaces.Box(-2.0, 2.0, (5,)), [8], th.nn.ReLU),
        (spaces.Discrete(6), [8], th.nn.Tanh),  # one-hot input: the first layer's tangent is a gather
        (spaces.Box(-2.0, 2.0, (5,)), [], th.nn.Tanh),  # no hidden layers: no tangent through the chain
    ],
)
def test_trpo_fisher_vector_product_equals_kl_hessian(action_space, observation_space, net_arch, activation):
    # H v of the mean KL at the rollout's parameters, by a tangent pass + backward, against sb3-contrib's double
    # backward (TRPO.hessian_vector_product), damping included
    th.manual_seed(0)
    arch = dict(pi=net_arch, vf=[8])
    kwargs = dict(net_arch=arch, activation_fn=activation, log_std_init=-0.3)
    policy = ActorCriticPolicy(observation_space, TRPO_ACTION_SPACES[action_space], lambda _: 1e-3, **kwargs)
    stock = copy.deepcopy(policy)
    obs = th.stack([th.as_tensor(observation_space.sample()) for _ in range(N)])
    actor = [p for name, p in stock.named_parameters() if "value" not in name]
    v = th.randn(sum(p.numel() for p in actor))
    damping = 0.1

    with th.no_grad():  # first, as stock: get_distribution fills and returns the policy's one distribution object
        old = copy.copy(stock.get_distribution(obs))
    dist = stock.get_distribution(obs)
    kl = kl_divergence(dist, old).mean()
    grad_kl = th.cat([g.reshape(-1) for g in th.autograd.grad(kl, actor, create_graph=True)])
    expected = TRPO.hessian_vector_product(SimpleNamespace(cg_damping=damping), actor, grad_kl, v)

    net = ActorCriticMlp(policy, split=True, shared=False)
    head = make_head(policy.action_dist, policy.action_space)
    fisher = make_output_fisher(head)
    with th.no_grad():
        x = net.inputs(obs)
        fisher.set_old(net.forward_part(x, 0), net.log_std)
        ours = FisherVectorProduct(net, fisher, slice(0, v.numel()), damping, N)(v)
    # the two sum the same products in other orders and groupings (float32): 1e-5 of the largest entry
    th.testing.assert_close(ours, expected.detach(), rtol=1e-4, atol=1e-5 * float(expected.abs().max()))
