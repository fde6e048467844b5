"""The frozen inference copies and heads, each against the stock torch/SB3 object (flat Adam: test_optim.py)."""

import numpy as np
import pytest
import stable_baselines3
import torch as th
from gymnasium import spaces
from stable_baselines3.common.policies import ActorCriticPolicy, MultiInputActorCriticPolicy
from torch import nn

from sb3_speedups.common.nn.blocked import BlockedMlpForward
from sb3_speedups.common.nn.flat import FlatParameters
from sb3_speedups.common.nn.mlp import parse_mlp
from sb3_speedups.common.nn.actor_critic_mlp import ActorCriticMlp
from sb3_speedups.common.nn.heads import make_head, sample_one_per_row
from sb3_speedups.common.acting.actors import FrozenActorCritic, TorchMlp, ModuleActorCritic
from sb3_speedups.common.acting.torch_mlp import one_row_addmv_is_addmm
from sb3_speedups.common.acting.mirror import ParameterMirror

ACTION_SPACES = {
    "discrete": spaces.Discrete(3),
    "box": spaces.Box(-2, 2, (2,)),
    "multidiscrete": spaces.MultiDiscrete([3, 2, 4]),
    "multibinary": spaces.MultiBinary(3),
}
OBS_SPACE = spaces.Box(-1, 1, (5,))


def make_policy(action_space, **kwargs):
    return ActorCriticPolicy(OBS_SPACE, action_space, lambda _: 1e-3, **kwargs)


@pytest.mark.parametrize("name", ACTION_SPACES)
def test_lean_actor_samples_as_the_policy(name):
    policy = make_policy(ACTION_SPACES[name])
    actor = FrozenActorCritic(policy, make_head(policy.action_dist, policy.action_space))
    obs = np.random.default_rng(0).uniform(-1, 1, (8, 5)).astype(np.float32)
    th.manual_seed(5)
    with th.no_grad():
        actions, values, log_probs = policy(th.as_tensor(obs))
    after_stock = th.rand(3)
    th.manual_seed(5)
    our_actions, our_values, our_log_probs = actor.act(obs)
    th.testing.assert_close(th.rand(3), after_stock)  # the RNG was drawn exactly as much
    if name == "box":  # mean + std * noise: the same draws, equal up to float32 rounding of the mean
        np.testing.assert_allclose(our_actions, actions.numpy(), rtol=0, atol=1e-6)
    else:
        np.testing.assert_array_equal(our_actions, actions.numpy())
    assert our_actions.dtype == actions.numpy().dtype
    th.testing.assert_close(our_values, values, rtol=0, atol=1e-6)
    th.testing.assert_close(our_log_probs, log_probs, rtol=0, atol=1e-5)
    th.testing.assert_close(actor.predict_values(obs), values.view(-1), rtol=0, atol=1e-6)


def test_module_actor_uses_lean_heads_and_matches_dict_policy():
    obs_space = spaces.Dict({"x": spaces.Box(-1, 1, (3,)), "k": spaces.Discrete(4)})
    policy = MultiInputActorCriticPolicy(obs_space, spaces.Discrete(3), lambda _: 1e-3)
    actor = ModuleActorCritic(policy)
    assert actor.head is not None and actor.policy is policy
    obs = {"x": np.zeros((4, 3), np.float32) + 0.3, "k": np.array([0, 1, 2, 3])}
    th.manual_seed(1)
    with th.no_grad():
        actions, values, log_probs = policy(policy.obs_to_tensor(obs)[0])
    th.manual_seed(1)
    mine = actor.act(obs)
    np.testing.assert_array_equal(mine[0], actions.numpy())
    th.testing.assert_close(mine[1], values)
    th.testing.assert_close(mine[2], log_probs)


def perturb(policy):
    with th.no_grad():
        for p in policy.parameters():
            p.add_(0.1)


def test_copies_are_frozen_until_synced():
    policy = make_policy(ACTION_SPACES["box"])
    ActorCriticMlp(policy)  # moves the parameters into one flat buffer: the mirror then syncs with one copy
    lean = FrozenActorCritic(policy, make_head(policy.action_dist, policy.action_space))
    module = ModuleActorCritic(policy, copy=True)
    assert module.policy is not policy
    obs = np.full((2, 5), 0.5, np.float32)
    before = lean.predict_values(obs).clone()
    perturb(policy)
    assert not lean.mirror.is_current() and not module.mirror.is_current()
    th.testing.assert_close(lean.predict_values(obs), before)
    lean.sync()
    module.sync()
    assert lean.mirror.is_current() and module.mirror.is_current()
    assert lean.mirror._tiling([s.detach() for s in lean.mirror.sources]) is not None
    with th.no_grad():
        expected = policy.predict_values(th.as_tensor(obs)).view(-1)
    th.testing.assert_close(lean.predict_values(obs), expected)
    th.testing.assert_close(module.predict_values(obs), expected)


def test_mirror_follows_scattered_sources():
    a, b = th.randn(3, 2), th.randn(4)
    mirror = ParameterMirror([a, b])
    a.add_(1.0)
    assert not mirror.is_current()
    mirror.sync()
    assert mirror.is_current()


def test_mirror_follows_a_parameter_moved_out_of_the_flat_buffer():
    policy = make_policy(ACTION_SPACES["discrete"])
    flat = FlatParameters(list(policy.parameters()))
    mirror = ParameterMirror(list(policy.parameters()))
    assert mirror._tiled is not None  # the sources tile the flat buffer: one copy per sync
    moved = next(policy.parameters())
    with th.no_grad():
        moved.data = moved.data.clone()
        moved.add_(1.0)
        flat.data.add_(1.0)
    mirror.sync()
    assert mirror.is_current() and mirror._tiled is None
    mirror.sync()
    assert mirror.is_current()


def test_lean_mlp_equals_sequential():
    seq = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 16), nn.LeakyReLU(0.2), nn.Linear(16, 3))
    lean = TorchMlp.from_module(seq, lambda t: t.detach())
    x = th.randn(7, 4)
    th.testing.assert_close(lean(x), seq(x).detach(), rtol=0, atol=0)
    assert isinstance(parse_mlp(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))), str)


@pytest.mark.parametrize("sizes", [(4, 256, 256, 20), (8, 64, 64, 2), (17, 400, 300, 6)])
def test_lean_mlp_one_row_equals_sequential_bit_for_bit(sizes):
    # One env's row runs as matrix-vector products where this machine's addmv gives addmm's bits (checked when built):
    # stock's Linear on that row must come out the same, or acting would part from stock's.
    th.manual_seed(0)
    layers: list[nn.Module] = []
    for k in range(len(sizes) - 1):
        layers += [nn.Linear(sizes[k], sizes[k + 1]), nn.ReLU()]
    seq = nn.Sequential(*layers[:-1])
    lean = TorchMlp.from_module(seq, lambda t: t.detach())
    linears = [m for m in seq if isinstance(m, nn.Linear)]
    # the one-row path runs exactly where the check finds the bits equal (on the CPUs measured: everywhere)
    assert (lean._row_layers is not None) == all(one_row_addmv_is_addmm(m.weight.detach(), m.bias) for m in linears)
    no_bias = TorchMlp.from_module(nn.Sequential(nn.Linear(4, 8, bias=False)), lambda t: t.detach())
    assert no_bias._row_layers is None
    with th.no_grad():
        for _ in range(20):
            x = th.randn(1, sizes[0]) * 3
            assert th.equal(lean(x), seq(x))


@pytest.mark.parametrize("k", [2, 3, 7])
def test_single_draw_equals_torch_multinomial(k):
    probs = th.softmax(th.randn(500, k), dim=-1)
    th.manual_seed(11)
    expected = th.multinomial(probs, 1, True)
    after = th.rand(2)
    th.manual_seed(11)
    th.testing.assert_close(sample_one_per_row(probs), expected, rtol=0, atol=0)
    th.testing.assert_close(th.rand(2), after)


@pytest.mark.parametrize(
    "policy_kwargs, numpy_path",
    [
        (dict(net_arch=dict(pi=[32], vf=[16, 16]), activation_fn=nn.ReLU), True),  # unequal networks: two chains
        (dict(net_arch=[16, 16], activation_fn=nn.ReLU), True),
        (dict(net_arch=[16], activation_fn=nn.ELU), False),  # no numpy twin: acts through torch
    ],
)
def test_numpy_forward_matches_the_policy(policy_kwargs, numpy_path):
    policy = make_policy(ACTION_SPACES["discrete"], **policy_kwargs)
    actor = FrozenActorCritic(policy, make_head(policy.action_dist, policy.action_space))
    assert (actor._numpy is not None) is numpy_path
    obs = np.random.default_rng(1).uniform(-1, 1, (6, 5)).astype(np.float64)  # float64 observations are cast
    th.manual_seed(2)
    with th.no_grad():
        actions, values, log_probs = policy(th.as_tensor(obs, dtype=th.float32))
    th.manual_seed(2)
    our_actions, our_values, our_log_probs = actor.act(obs)
    np.testing.assert_array_equal(our_actions, actions.numpy())
    th.testing.assert_close(our_values, values, rtol=0, atol=1e-6)
    th.testing.assert_close(our_log_probs, log_probs, rtol=0, atol=1e-6)
    perturb(policy)  # the numpy views follow the mirror: stale until synced, current after
    assert not np.allclose(actor.act(obs)[1].numpy(), policy.predict_values(th.as_tensor(obs, dtype=th.float32)).detach())
    actor.sync()
    th.testing.assert_close(
        actor.act(obs)[1], policy.predict_values(th.as_tensor(obs, dtype=th.float32)).detach(), atol=1e-6, rtol=0
    )


def test_numpy_forward_only_for_single_threaded_products():
    policy = make_policy(ACTION_SPACES["discrete"], net_arch=[256, 256])
    actor = FrozenActorCritic(policy, make_head(policy.action_dist, policy.action_space))
    assert actor._numpy is not None
    assert actor._numpy.accepts(1) and not actor._numpy.accepts(8)  # 8 x 256 x 256 would spread over BLAS threads
    obs = np.random.default_rng(2).uniform(-1, 1, (8, 5)).astype(np.float32)
    th.manual_seed(4)
    with th.no_grad():
        actions, values, _ = policy(th.as_tensor(obs))
    th.manual_seed(4)
    our_actions, our_values, _ = actor.act(obs)  # through torch
    np.testing.assert_array_equal(our_actions, actions.numpy())
    th.testing.assert_close(our_values, values, rtol=0, atol=1e-6)


@pytest.mark.parametrize("act", [nn.ReLU, nn.Tanh])
def test_buffered_mlp_forward_equals_the_module_and_keeps_its_buffers(act):
    th.manual_seed(0)
    seq = nn.Sequential(nn.Linear(5, 32), act(), nn.Linear(32, 32), act(), nn.Linear(32, 3))
    forward = BlockedMlpForward.from_sequential(seq, rows=64)
    assert forward is not None
    x = th.randn(150, 5)  # two full blocks and a partial one
    with th.no_grad():
        expected = seq(x)
    out = forward(x)
    # Blocks of 64, 64 and 22 rows against one product of 150: other kernels per shape (they round differently on
    # AVX2 CPUs), so within float32 rounding of 32-term sums of O(1) values.
    th.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    pointer = out.data_ptr()
    with th.inference_mode():  # as in DQN.train(): the kept buffers stay writable
        again = forward(x * 2)
    assert again.data_ptr() == pointer and not again.is_inference()
    with th.no_grad():
        th.testing.assert_close(again, seq(x * 2), rtol=0, atol=1e-6)
    with th.no_grad():  # it reads the layers' current weights
        seq[0].weight.add_(1.0)
        th.testing.assert_close(forward(x), seq(x), rtol=0, atol=1e-5)  # outputs of O(10) after the weights moved by 1
    assert BlockedMlpForward.from_sequential(nn.Sequential(nn.Linear(5, 3), nn.Sigmoid())) is None
    assert BlockedMlpForward.from_sequential(nn.Sequential(nn.Linear(5, 8), nn.ELU(), nn.Linear(8, 3))) is None


def test_copy_of_a_gsde_policy_after_training():
    # gSDE keeps its exploration matrix as an autograd result, which deepcopy refuses: the copy (what a GPU-trained
    # model acts from) takes it detached, with the same values
    model = stable_baselines3.PPO("MlpPolicy", "Pendulum-v1", use_sde=True, n_steps=64, batch_size=64, n_epochs=1, seed=0)
    model.learn(128)
    exploration = model.policy.action_dist.exploration_mat
    assert exploration.grad_fn is not None
    actor = ModuleActorCritic(model.policy, copy=True)
    copied = actor.policy.action_dist.exploration_mat
    assert copied.grad_fn is None and th.equal(copied, exploration)
    assert model.policy.action_dist.exploration_mat is exploration  # the original is left as it was
    obs = np.zeros((3, 3), np.float32)
    th.testing.assert_close(actor.predict_values(obs), model.policy.predict_values(th.as_tensor(obs)).view(-1).detach())


OBSERVATION_SPACES = {
    "discrete": spaces.Discrete(7),
    "multidiscrete": spaces.MultiDiscrete([3, 5, 2]),
    "multibinary": spaces.MultiBinary(4),
}


@pytest.mark.parametrize("n", [8, 64])  # numpy acting for a few rows, torch for many (numpy's BLAS threads)
@pytest.mark.parametrize("name", OBSERVATION_SPACES)
def test_lean_actor_acts_on_discrete_and_binary_observations(name, n):
    """SB3 one-hot encodes Discrete/MultiDiscrete observations; the frozen actor gathers the hot columns' weights."""
    space = OBSERVATION_SPACES[name]
    space.seed(3)
    policy = ActorCriticPolicy(space, spaces.Discrete(3), lambda _: 1e-3)
    actor = FrozenActorCritic(policy, make_head(policy.action_dist, policy.action_space))
    assert actor._numpy is not None and actor._numpy.accepts(8) and not actor._numpy.accepts(64)
    obs = np.stack([space.sample() for _ in range(n)])  # as a VecEnv hands them over: [n] for Discrete
    th.manual_seed(5)
    with th.no_grad():
        actions, values, log_probs = policy(th.as_tensor(obs))
    th.manual_seed(5)
    our_actions, our_values, our_log_probs = actor.act(obs)
    np.testing.assert_array_equal(our_actions, actions.numpy())
    th.testing.assert_close(our_values, values, rtol=0, atol=1e-6)  # gather vs one-hot product: float32 rounding
    th.testing.assert_close(our_log_probs, log_probs, rtol=0, atol=1e-6)
    th.testing.assert_close(actor.predict_values(obs), values.view(-1), rtol=0, atol=1e-6)
