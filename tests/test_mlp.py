"""The MLP description, its one parser and each executor against the module's own forward (and autograd)."""

import itertools

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy
from torch import nn

from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.acting.numpy_actor import NumpyActorCritic, NumpyMlp
from sb3_speedups.common.nn.actor_critic import mlp_unsupported_reason, parse_actor_critic
from sb3_speedups.common.nn.blocked import BlockedMlpForward, forward_in_blocks
from sb3_speedups.common.nn.mlp import NONE, RELU, TANH, parse_mlp, parse_output_mlp, stack
from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp

OBS_SPACE = spaces.Box(-1, 1, (5,))


def mlp_module(act, sizes=(5, 16, 16, 3)):
    layers = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(act())
    return nn.Sequential(*layers)


def test_parser_describes_layers_and_activations():
    th.manual_seed(0)
    seq = mlp_module(nn.Tanh)
    mlp = parse_mlp(seq)
    assert not isinstance(mlp, str)
    assert [layer.activation for layer in mlp.layers] == [TANH, TANH, NONE]
    assert all(layer.weight is lin.weight for layer, lin in zip(mlp.layers, seq[0::2], strict=True))
    assert not mlp.stacked and mlp.head()[0].activation is TANH
    single = parse_mlp(nn.Linear(3, 2))
    assert not isinstance(single, str) and len(single.layers) == 1
    assert parse_mlp(nn.Sequential(nn.ReLU(), nn.Linear(2, 2))) == "ReLU is not an nn.Linear or an activation after one"
    assert isinstance(parse_mlp(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))), str)
    assert isinstance(parse_mlp(nn.Conv1d(2, 2, 1)), str)
    elu = parse_mlp(mlp_module(nn.ELU))
    assert not isinstance(elu, str) and elu.layers[0].activation.name == "ELU"
    assert elu.layers[0].activation.numpy is None and elu.layers[0].activation.backward is None


def test_unsupported_activations_are_reported():
    for act in (nn.ELU, nn.Sigmoid, nn.LeakyReLU):
        seq = mlp_module(act)
        assert "Tanh or ReLU" in parse_output_mlp(seq)
        assert BlockedMlpForward.from_sequential(seq) is None
        mlp = parse_mlp(seq)
        assert "numpy" in NumpyMlp.unsupported_reason(mlp)
        policy = ActorCriticPolicy(OBS_SPACE, spaces.Discrete(3), lambda _: 1e-3, net_arch=[8], activation_fn=act)
        assert "Tanh or ReLU" in mlp_unsupported_reason(policy)
        ac = parse_actor_critic(policy)
        assert NumpyActorCritic.build([ac.pi, ac.vf], ac.action, ac.value) is None
        with pytest.raises(ValueError, match="Tanh or ReLU"):
            ActorCriticMlp(policy)
    assert "Tanh or ReLU" in parse_output_mlp(nn.Sequential(nn.Linear(3, 2), nn.ReLU()))  # the last layer activated
    assert "bias" in parse_output_mlp(nn.Sequential(nn.Linear(3, 2, bias=False)))


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh, nn.LeakyReLU])
def test_torch_acting_equals_the_module(act):
    th.manual_seed(1)
    a, b = mlp_module(act), mlp_module(act)
    x = th.randn(9, 5)
    with th.no_grad():
        expected = [a(x), b(x)]
        assert th.equal(TorchMlp.from_module(a, lambda t: t.detach())(x), expected[0])
        mlp_a, mlp_b = parse_mlp(a), parse_mlp(b)
        if act is not nn.LeakyReLU:  # stacked: one baddbmm per layer over [2, ...] copies
            stacked = stack([mlp_a.map(th.Tensor.detach), mlp_b.map(th.Tensor.detach)], th.stack)
            assert stacked.stacked
            out = TorchMlp(stacked)(x)
            for g in range(2):
                th.testing.assert_close(out[g], expected[g], rtol=0, atol=1e-6)


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
def test_numpy_acting_equals_the_module(act):
    th.manual_seed(2)
    seq = mlp_module(act)
    x = th.randn(6, 5)
    with th.no_grad():
        expected = seq(x).numpy()
    out = NumpyMlp(parse_mlp(seq).map(th.Tensor.detach))(x.numpy())
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-6)  # numpy's products and tanh against torch's


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
def test_blocked_forward_equals_the_module(act):
    th.manual_seed(3)
    seq = mlp_module(act)
    blocked, whole = BlockedMlpForward.from_sequential(seq, rows=4), BlockedMlpForward.from_sequential(seq, rows=10)
    x = th.randn(10, 5)
    with th.no_grad():
        expected = seq(x)
        assert th.equal(whole(x), expected)  # one block: the module's own addmm on the same shapes
        # Blocks of 4, 4 and 2 rows against one product of 10: MKL picks other kernels per shape (on AVX2 CPUs they
        # round differently), so float32 rounding of 16-term sums of O(1) values: well under 1e-6.
        th.testing.assert_close(blocked(x), expected, rtol=0, atol=1e-6)
        th.testing.assert_close(forward_in_blocks(seq, x, rows=4), expected, rtol=0, atol=1e-6)  # any row-wise module


def _policy(net_arch, act):
    th.manual_seed(4)
    return ActorCriticPolicy(OBS_SPACE, spaces.Box(-1, 1, (2,)), lambda _: 1e-3, net_arch=net_arch, activation_fn=act)


ARCHS = [
    ([16, 16], nn.Tanh, False),  # stacked pair
    ([16, 16], nn.ReLU, False),
    (dict(pi=[16], vf=[8, 8]), nn.Tanh, False),  # two chains
    ([], nn.Tanh, False),  # no hidden layers
    ([16, 16], nn.Tanh, True),  # split: actor and critic apart
]


@pytest.mark.parametrize("net_arch,act,split", ARCHS)
def test_training_forward_equals_the_module_and_backward_autograd(net_arch, act, split):
    policy = _policy(net_arch, act)
    net = ActorCriticMlp(policy, split=split)
    assert net.stacked is (not split and not isinstance(net_arch, dict))
    x = th.randn(12, 5)
    if split:
        out, values = net.forward_part(x, 0).clone(), net.forward_part(x, 1).clone()
    else:
        out, values = (t.clone() for t in net.forward(x))
    latent_pi, latent_vf = policy.mlp_extractor(x)
    ref_out, ref_values = policy.action_net(latent_pi), policy.value_net(latent_vf)
    tol = 1e-6  # batched products, and numpy's kernels on the CPU, against the module's
    th.testing.assert_close(out, ref_out.detach(), rtol=0, atol=tol)
    th.testing.assert_close(values, ref_values.detach().view(-1), rtol=0, atol=tol)
    th.testing.assert_close(net.predict_values(x), ref_values.detach().view(-1), rtol=0, atol=tol)
    d_out, d_values = th.randn_like(out), th.randn(12, 1)
    if split:
        net.backward_part(d_out, 0)
        net.backward_part(d_values, 1)
    else:
        net.backward(d_out, d_values)
    policy.zero_grad()
    ((ref_out * d_out).sum() + (ref_values * d_values).sum()).backward()
    for p in policy.parameters():
        if p is policy.log_std:
            continue
        th.testing.assert_close(net.flat.grad_of(p), p.grad, rtol=1e-5, atol=1e-6)


def test_training_activations_are_in_place_kernels():
    x = th.randn(4, 3)
    for activation in (TANH, RELU):
        y = x.clone()
        assert activation.torch_(y) is y
        th.testing.assert_close(y, activation.torch(x), rtol=0, atol=0)
