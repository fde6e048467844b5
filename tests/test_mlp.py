"""The MLP description, its one parser and each executor against the module's own forward (and autograd)."""

import itertools

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy, MultiInputActorCriticPolicy
from stable_baselines3.common.preprocessing import get_flattened_obs_dim, preprocess_obs
from stable_baselines3.common.utils import obs_as_tensor
from torch import nn

from sb3_speedups.common.acting.torch_mlp import TorchMlp
from sb3_speedups.common.acting.numpy_actor import NumpyActorCritic, NumpyMlp
from sb3_speedups.common.nn.actor_critic import mlp_unsupported_reason, parse_actor_critic
from sb3_speedups.common.nn.inputs import flat_input_unsupported_reason, float_rows
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
    _assert_executor_equals_module(net, policy, x, x, split)


def _assert_executor_equals_module(net: ActorCriticMlp, policy: ActorCriticPolicy, x: th.Tensor, obs: th.Tensor, split: bool):
    """
    ``net``'s forward on its inputs ``x`` against the module's on the observations ``obs``, and its backward against
    autograd: forward within 1e-6 (batched products, a gather, numpy's kernels against the module's), gradients
    within rtol 1e-5 (sums over the batch, and index-adds, in another order)
    """
    if split:
        out, values = net.forward_part(x, 0).clone(), net.forward_part(x, 1).clone()
    else:
        out, values = (t.clone() for t in net.forward(x))
    latent_pi, latent_vf = policy.mlp_extractor(policy.extract_features(obs))
    ref_out, ref_values = policy.action_net(latent_pi), policy.value_net(latent_vf)
    tol = 1e-6
    th.testing.assert_close(out, ref_out.detach(), rtol=0, atol=tol)
    th.testing.assert_close(values, ref_values.detach().view(-1), rtol=0, atol=tol)
    th.testing.assert_close(net.predict_values(x), ref_values.detach().view(-1), rtol=0, atol=tol)
    d_out, d_values = th.randn_like(out), th.randn(len(obs), 1)
    if split:
        net.backward_part(d_out, 0)
        net.backward_part(d_values, 1)
    else:
        net.backward(d_out, d_values)
    policy.zero_grad()
    ((ref_out * d_out).sum() + (ref_values * d_values).sum()).backward()
    for p in policy.parameters():
        if p is not policy.log_std:
            th.testing.assert_close(net.flat.grad_of(p), p.grad, rtol=1e-5, atol=1e-6)


def test_training_activations_are_in_place_kernels():
    x = th.randn(4, 3)
    for activation in (TANH, RELU):
        y = x.clone()
        assert activation.torch_(y) is y
        th.testing.assert_close(y, activation.torch(x), rtol=0, atol=0)


ONE_HOT_SPACES = {"discrete": spaces.Discrete(7), "multidiscrete": spaces.MultiDiscrete([3, 5, 2])}


def _codes(space, n, seed=0):
    """:return: ``n`` observations of ``space`` as the buffers store them (int64, ``[n, k]``)"""
    rng = np.random.default_rng(seed)
    nvec = [space.n] if isinstance(space, spaces.Discrete) else list(space.nvec)
    return np.stack([rng.integers(k, size=n) for k in nvec], axis=1).astype(np.int64)


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
@pytest.mark.parametrize("name", ONE_HOT_SPACES)
def test_one_hot_input_acting_and_blocked_equal_the_module_on_one_hot_rows(name, act):
    """A one-hot first layer as a gather of the hot columns' weights: what the module computes on SB3's one-hot rows."""
    space = ONE_HOT_SPACES[name]
    th.manual_seed(5)
    a, b = (mlp_module(act, sizes=(get_flattened_obs_dim(space), 16, 16, 3)) for _ in range(2))
    obs = _codes(space, 10)
    rows = preprocess_obs(th.as_tensor(obs).view(10, -1) if name == "multidiscrete" else th.as_tensor(obs[:, 0]), space)
    mlp_a, mlp_b = (parse_mlp(m).map(th.Tensor.detach).observing(space) for m in (a, b))
    columns = mlp_a.inputs(th.as_tensor(obs))
    assert columns.dtype == th.int64 and columns.shape == (10, len(mlp_a.one_hot.offsets))
    with th.no_grad():
        expected = [a(rows), b(rows)]
    # The gather adds the k hot weights and the bias in another order than the module's product: float32 rounding
    # of O(1) values (bit-equal for one component, one addition either way), well under 1e-6.
    tol = dict(rtol=0, atol=1e-6)
    th.testing.assert_close(TorchMlp(mlp_a)(columns), expected[0], **tol)
    stacked = TorchMlp(stack([mlp_a, mlp_b], th.stack))(columns)
    for g in range(2):
        th.testing.assert_close(stacked[g], expected[g], **tol)
    numpy = NumpyMlp(mlp_a)
    np.testing.assert_allclose(numpy(numpy.inputs(obs)), expected[0].numpy(), **tol)
    output_mlp = parse_output_mlp(a)
    assert not isinstance(output_mlp, str)
    blocked = BlockedMlpForward(output_mlp.observing(space), rows=4)
    th.testing.assert_close(blocked(columns), expected[0], **tol)


ONE_HOT_ARCHS = [([16, 16], nn.Tanh, False), (dict(pi=[16], vf=[8, 8]), nn.ReLU, False), ([16, 16], nn.Tanh, True)]


@pytest.mark.parametrize("net_arch,act,split", ONE_HOT_ARCHS)
@pytest.mark.parametrize("name", ONE_HOT_SPACES)
def test_one_hot_input_training_equals_the_module_and_backward_autograd(name, net_arch, act, split):
    """The training executor's gather forward and its index-add weight gradient against autograd on one-hot rows."""
    space = ONE_HOT_SPACES[name]
    th.manual_seed(6)
    policy = ActorCriticPolicy(space, spaces.Box(-1, 1, (2,)), lambda _: 1e-3, net_arch=net_arch, activation_fn=act)
    assert mlp_unsupported_reason(policy) is None
    net = ActorCriticMlp(policy, split=split)
    obs = th.as_tensor(_codes(space, 40, seed=1))  # 40 rows over 7 (or 10) columns: each hot column seen many times
    obs = obs if name == "multidiscrete" else obs[:, 0]
    _assert_executor_equals_module(net, policy, net.inputs(obs), obs, split)  # the module: SB3's one-hot rows


def test_one_hot_inputs_that_the_executors_cannot_take_are_reported():
    no_hidden = ActorCriticPolicy(spaces.Discrete(4), spaces.Discrete(2), lambda _: 1e-3, net_arch=[])
    assert "one-hot input without a Linear layer" in mlp_unsupported_reason(no_hidden)
    shifted = ActorCriticPolicy(spaces.Discrete(4, start=1), spaces.Discrete(2), lambda _: 1e-3, net_arch=[8])
    assert "not a flat Box, Discrete" in mlp_unsupported_reason(shifted)
    binary = ActorCriticPolicy(spaces.MultiBinary(3), spaces.Discrete(2), lambda _: 1e-3, net_arch=[8])
    assert mlp_unsupported_reason(binary) is None  # float rows, as a flat Box
    ac = parse_actor_critic(binary)
    assert not isinstance(ac, str) and ac.pi.one_hot is None


DICT_SPACE = spaces.Dict(
    {
        "state": spaces.Box(-1, 1, (2, 2), np.float32),
        "mode": spaces.Discrete(4),
        "goal": spaces.Box(-1, 1, (3,), np.float64),
        "code": spaces.MultiDiscrete([3, 2]),
        "flags": spaces.MultiBinary(2),
    }
)


def test_dict_observations_are_the_float_rows_of_stocks_combined_extractor():
    """``MultiInputPolicy``'s extractor on SB3's preprocessing: the rows ours makes from tensors and from numpy."""
    policy = MultiInputActorCriticPolicy(DICT_SPACE, spaces.Discrete(3), lambda _: 1e-3, net_arch=[8])
    assert mlp_unsupported_reason(policy) is None
    DICT_SPACE.seed(3)
    samples = [DICT_SPACE.sample() for _ in range(9)]
    obs = {key: np.stack([np.asarray(s[key]) for s in samples]) for key in DICT_SPACE.spaces}
    with th.no_grad():
        expected = policy.extract_features(obs_as_tensor(obs, "cpu"), policy.features_extractor)
    rows = float_rows(DICT_SPACE)
    assert rows.width == expected.shape[1] == 4 + 4 + 3 + 5 + 2
    th.testing.assert_close(rows.rows(obs), expected, rtol=0, atol=0)  # the same values, copied
    np.testing.assert_array_equal(rows.rows_numpy(obs), expected.numpy())
    ac = parse_actor_critic(policy)
    assert not isinstance(ac, str) and ac.pi.dict_input == rows and ac.pi.one_hot is None
    th.testing.assert_close(ac.pi.inputs(obs_as_tensor(obs, "cpu")), expected, rtol=0, atol=0)


def test_dict_observations_the_executors_cannot_take_are_reported():
    image = spaces.Dict({"pixels": spaces.Box(0, 255, (1, 36, 36), np.uint8), "state": spaces.Box(-1, 1, (3,))})
    assert "entry 'pixels'" in flat_input_unsupported_reason(image)
    nested = spaces.Dict({"inner": spaces.Dict({"state": spaces.Box(-1, 1, (3,))})})
    assert "a nested Dict" in flat_input_unsupported_reason(nested)
    policy = MultiInputActorCriticPolicy(image, spaces.Discrete(3), lambda _: 1e-3, net_arch=[8])
    assert "not a flat Box" in mlp_unsupported_reason(policy)
