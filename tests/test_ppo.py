"""Our PPO: hand-derived gradients against autograd, every action space, the fallbacks, its options and samplers."""

import numpy as np
import pytest
import stable_baselines3
import torch as th
from gymnasium import spaces
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.vec_env import VecFrameStack, VecNormalize

from sb3_speedups import PPO
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.common.on_policy.buffers import env_major_to_time_major
from sb3_speedups.common.torch_utils import is_channels_last
from sb3_speedups.ppo.minibatches import Minibatch, MinibatchSampler
from sb3_speedups.ppo.update import STATS, AutogradPPOUpdate, HandDerivedPPOUpdate, PPOLossConfig
from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo
from tests.algo_cases import PPO_SMALL as SMALL
from tests.algo_cases import Counter
from tests.space_envs import ACTION_SPACES, box_env, image_env, rollout_case


@pytest.mark.parametrize("name", ACTION_SPACES)
@pytest.mark.parametrize("clip_range_vf", [None, 0.2])
@pytest.mark.parametrize("ent_coef", [0.0, 0.05])
def test_hand_derived_gradients_equal_autograd(name, clip_range_vf, ent_coef):
    th.manual_seed(0)
    obs_space, action_space = spaces.Box(-1, 1, (5,)), ACTION_SPACES[name]
    ours = ActorCriticPolicy(obs_space, action_space, lambda _: 1e-3)
    stock = ActorCriticPolicy(obs_space, action_space, lambda _: 1e-3)
    stock.load_state_dict(ours.state_dict())
    n = 37
    obs = th.randn(n, 5)
    with th.no_grad():
        actions = ours(obs)[0].float().reshape(n, -1)
    old_log_prob = th.randn(n) * 0.1 - 1.0  # ratios far from 1: both branches of the clipped surrogate are hit
    args = (th.randn(n), old_log_prob, th.randn(n), th.randn(n))  # old values, log-probs, advantages, returns
    cfg = PPOLossConfig(0.1, clip_range_vf, ent_coef, 0.5, 0.5)
    head = make_head(ours.action_dist, action_space)
    manual, autograd = HandDerivedPPOUpdate(ours, head), AutogradPPOUpdate(stock)
    autograd.head = None  # stock SB3's evaluate_actions and distribution objects
    stats_manual, stats_autograd = th.empty(len(STATS)), th.empty(len(STATS))
    manual.forward(Minibatch(obs, head.training_actions(actions), *args), cfg, stats_manual)
    manual.backward()
    autograd.forward(Minibatch(obs, {"actions": actions}, *args), cfg, stats_autograd)
    autograd.backward()
    for p, q in zip(ours.parameters(), stock.parameters(), strict=True):
        th.testing.assert_close(manual.flat.grad_of(p), q.grad, rtol=1e-4, atol=1e-6)
    th.testing.assert_close(stats_manual, stats_autograd, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("clip_range_vf", [None, 0.15])
def test_device_scalars_give_the_same_update(clip_range_vf):
    # what a recorded CUDA graph reads the scheduled numbers from: the same loss, gradients and (up to the float32
    # learning rate) step; back on host scalars, the arguments count again
    th.manual_seed(0)
    obs_space, action_space = spaces.Box(-1, 1, (5,)), ACTION_SPACES["discrete"]
    policies = [ActorCriticPolicy(obs_space, action_space, lambda _: 1e-3) for _ in range(2)]
    policies[1].load_state_dict(policies[0].state_dict())
    n = 37
    obs = th.randn(n, 5)
    with th.no_grad():
        actions = policies[0](obs)[0].float().reshape(n, -1)
    args = (th.randn(n), th.randn(n) * 0.1 - 1.0, th.randn(n), th.randn(n))
    head = make_head(policies[0].action_dist, action_space)
    host, device = (HandDerivedPPOUpdate(p, head) for p in policies)
    cfg = PPOLossConfig(0.1, clip_range_vf, 0.01, 0.5, 0.5)
    device.set_device_scalars(PPOLossConfig(0.3, 0.4, 0.01, 0.5, 0.5), 5e-3)
    device.set_device_scalars(cfg, 1e-3)  # the latest values count
    stats = [th.empty(len(STATS)), th.empty(len(STATS))]
    for update, row in zip((host, device), stats, strict=True):
        update.forward(Minibatch(obs, head.training_actions(actions), *args), cfg, row)
        update.backward()
    assert th.equal(stats[0], stats[1]) and th.equal(host.flat.grad, device.flat.grad)
    before = host.flat.data.clone()
    host.optimizer_step(0.5)
    device.optimizer_step(0.5)
    step = (host.flat.data - before).abs()
    assert step.max() > 5e-4  # Adam's first step moves by about lr
    assert (host.flat.data - device.flat.data).abs().max() < 1e-4 * step.max()
    device.set_device_scalars(PPOLossConfig(0.3, 0.4, 0.01, 0.5, 0.5), 5e-3)
    device.use_host_scalars()
    for update, row in zip((host, device), stats, strict=True):
        update.forward(Minibatch(obs, head.training_actions(actions), *args), cfg, row)
    th.testing.assert_close(stats[0], stats[1], rtol=1e-6, atol=1e-7)


@pytest.mark.skipif(not th.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kwargs", [{}, dict(clip_range_vf=lambda p: 0.3 * p, recompute_advantages=True)])
def test_cuda_graph_epochs_equal_op_by_op_epochs(kwargs):
    # the replayed epochs must give the op-by-op parameters bit for bit
    config = dict(n_steps=64, batch_size=64, n_epochs=4, clip_range=lambda p: 0.2 * p, learning_rate=lambda p: 3e-4 * p)
    models = [PPO("MlpPolicy", box_env("discrete"), device="cuda", seed=3, cuda_graphs=g, **config, **kwargs) for g in (0, 1)]
    callbacks = [m._setup_learn(10**5)[1] for m in models]
    for cycle in range(1, 4):
        for model, callback in zip(models, callbacks, strict=True):
            th.manual_seed(cycle)  # both draw the same actions and minibatch orders while their parameters agree
            np.random.seed(cycle)
            model._update_current_progress_remaining(cycle * 256, 10**4)
            model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
            model.train()
        np.testing.assert_array_equal(*(m.policy.parameters_to_vector() for m in models))
    graphs = models[1]._speedups.graphs
    assert graphs is not None and graphs.graph is not None and graphs.failed is None
    assert models[0]._speedups.graphs is None


def test_cuda_graphs_only_on_a_cuda_device():
    model = PPO("MlpPolicy", box_env("discrete"), seed=0, **SMALL)
    model.learn(2 * SMALL["n_steps"] * 4)
    speed = model._speedups
    assert model.cuda_graphs and speed.graphs is None and speed.updater._scalars is None
    assert model._graphed_epochs(speed, speed.sampler, PPOLossConfig(0.2, None, 0.0, 0.5, 0.5)) is None


@pytest.mark.parametrize("net_arch,activation", [(dict(pi=[32], vf=[16, 16]), th.nn.ReLU), ([], th.nn.Tanh)])
def test_hand_derived_gradients_other_architectures(net_arch, activation):
    obs_space, action_space = spaces.Box(-1, 1, (5,)), ACTION_SPACES["discrete"]
    kwargs = dict(net_arch=net_arch, activation_fn=activation)
    ours = ActorCriticPolicy(obs_space, action_space, lambda _: 1e-3, **kwargs)
    stock = ActorCriticPolicy(obs_space, action_space, lambda _: 1e-3, **kwargs)
    stock.load_state_dict(ours.state_dict())
    obs, actions = th.randn(16, 5), th.randint(0, 3, (16, 1)).float()
    args = (th.randn(16), th.randn(16) - 1.0, th.randn(16), th.randn(16))
    cfg = PPOLossConfig(0.2, 0.1, 0.01, 0.5, 0.5)
    manual = HandDerivedPPOUpdate(ours, make_head(ours.action_dist, action_space))
    autograd = AutogradPPOUpdate(stock)
    manual.forward(Minibatch(obs, manual.training_actions(actions), *args), cfg, th.empty(len(STATS)))
    manual.backward()
    autograd.forward(Minibatch(obs, {"actions": actions}, *args), cfg, th.empty(len(STATS)))
    autograd.backward()
    for p, q in zip(ours.parameters(), stock.parameters(), strict=True):
        th.testing.assert_close(manual.flat.grad_of(p), q.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ACTION_SPACES)
@pytest.mark.parametrize("fast_update", [True, False])
def test_learn_every_action_space_fast_and_fallback(name, fast_update):
    model = PPO("MlpPolicy", box_env(name), seed=0, fast_update=fast_update, **SMALL)
    before = [p.detach().clone() for p in model.policy.parameters()]
    counter = Counter()
    model.learn(128, callback=counter)
    assert (model.fast_path_unsupported_reason() is None) == fast_update
    assert isinstance(model._speedups.updater, HandDerivedPPOUpdate if fast_update else AutogradPPOUpdate)
    assert counter.steps == 128 // 4 and counter.starts == counter.ends == 2
    assert {"infos", "dones", "rewards", "new_obs", "actions", "values", "log_probs", "self"} <= counter.keys
    assert all(not th.equal(p, q) for p, q in zip(model.policy.parameters(), before, strict=True))
    assert np.isfinite(model.logger.name_to_value["train/value_loss"])


@pytest.mark.parametrize("name,reason", [("dict", "observation space"), ("image", "observation space"), ("box_sde", "gSDE")])
def test_other_policies_learn_with_the_autograd_update(name, reason):
    env, policy, kwargs = rollout_case(name)
    model = PPO(policy, env(), seed=0, **SMALL, **kwargs)
    before = [p.detach().clone() for p in model.policy.parameters()]
    model.learn(64)
    assert reason in model.fast_path_unsupported_reason()
    updater = model._speedups.updater
    assert isinstance(updater, AutogradPPOUpdate) and updater.adam is not None  # flat fused Adam all the same
    assert model.num_timesteps == 64
    assert any(not th.equal(p, q) for p, q in zip(model.policy.parameters(), before, strict=True))


@pytest.mark.parametrize("policy,channels_last", [("CnnPolicy", True), ("MlpPolicy", False)])
@pytest.mark.parametrize("gather", ["epoch", "minibatch"])
def test_image_rollouts_are_stored_and_served_channels_last_to_convolutions(policy, channels_last, gather):
    """A CNN trained on the CPU reads image observations channels-last: the rollout stores them so (SB3's shape and
    values) and both gathers serve them so, the same rows as plain indexing; an MLP keeps SB3's plain layout."""
    model = PPO(policy, VecFrameStack(image_env(spaces.Discrete(3))(), 4), seed=0, **SMALL)  # 4 channels, as Atari's
    model.learn(2 * SMALL["n_steps"] * model.n_envs)
    buffer = model.rollout_buffer
    obs = buffer.observations
    assert obs.shape == (model.n_steps, model.n_envs, *model.observation_space.shape)
    assert (obs.strides[2] == obs.itemsize) == channels_last  # channels innermost in memory
    flat = buffer.flat_observations()
    assert is_channels_last(flat) == channels_last
    assert np.array_equal(flat.numpy(), np.ascontiguousarray(obs).reshape(flat.shape))
    assert flat.float().std() > 0  # real frames, not the zeros of an empty buffer
    # plain rows (as ALE's vector env hands them over) are stored as they are, into the same layout
    rows = np.random.default_rng(0).integers(0, 256, obs.shape[1:], dtype=np.uint8)
    buffer.reset()
    zeros = np.zeros(model.n_envs, dtype=np.float32)
    buffer.add(rows, zeros[:, None], zeros, zeros, th.zeros(model.n_envs), th.zeros(model.n_envs))
    assert np.array_equal(buffer.observations[0], rows) and buffer.observations.strides == obs.strides
    sampler = MinibatchSampler(model.n_steps, model.n_envs, 8, model.device, gather_observations=gather)
    sampler.load(flat, {"actions": buffer.flat("actions")}, th.zeros(4, flat.shape[0]))
    sampler.shuffle()
    for mb in sampler.minibatches():
        assert is_channels_last(mb.observations) == channels_last
        assert th.equal(mb.observations, flat[sampler.index[mb.start : mb.end]])


def test_collection_acts_from_a_copy_synced_once_per_rollout():
    model = PPO("MlpPolicy", box_env("box"), seed=0, **SMALL)
    _, callback = model._setup_learn(1000, None)
    model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
    mirror = model._speedups.actor.mirror
    assert mirror.is_current() and mirror.flat.data_ptr() != model._speedups.updater.flat.data.data_ptr()
    model.train()
    assert not mirror.is_current()  # training does not touch the acting copy ...
    model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
    assert mirror.is_current()  # ... the next rollout starts with one sync


def test_vecnormalize_and_schedules_for_gamma_and_lambda():
    env = VecNormalize(box_env("discrete"), gamma=0.9)
    model = PPO("MlpPolicy", env, seed=0, gamma=lambda p: 0.8 + 0.1 * p, gae_lambda=lambda p: 0.5 + 0.4 * p, **SMALL)
    assert model.gamma == pytest.approx(0.9)
    model.learn(192)
    buffer = model.rollout_buffer
    assert 0.8 < model.gamma < 0.9 and buffer.gamma == model.gamma and 0.5 < buffer.gae_lambda < 0.9
    assert env.obs_rms.count > 192
    assert isinstance(model.gamma, float)  # what stock SB3 finds in a saved file


@pytest.mark.parametrize("recompute", [False, True])
def test_recompute_advantages_after_the_first_epoch(recompute):
    model = PPO("MlpPolicy", box_env("box"), seed=0, recompute_advantages=recompute, **SMALL)
    _, callback = model._setup_learn(1000, None)
    model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
    before = model.rollout_buffer.advantages.copy()
    model.train()
    changed = not np.allclose(model.rollout_buffer.advantages, before)
    assert changed == recompute


def test_batch_normalisation_with_target_kl():
    model = PPO(
        "MlpPolicy",
        box_env("discrete"),
        seed=0,
        normalize_advantage="batch",
        target_kl=1e-9,
        n_steps=16,
        batch_size=16,
        n_epochs=5,
    )
    model.learn(64)
    assert model._n_updates == 1  # each train() stops in its first epoch


def test_unknown_normalize_advantage_is_refused():
    with pytest.raises(UserError, match="normalize_advantage"):
        PPO("MlpPolicy", box_env("discrete"), normalize_advantage="per-sample")


def test_cli_registry_uses_ours_unless_stock():
    assert get_algo("ppo").cls() is PPO
    assert get_algo("ppo").cls(stock=True) is stable_baselines3.PPO


@pytest.mark.slow
def test_cartpole_improves():
    env = make_vec_env("CartPole-v1", n_envs=8, seed=0)
    model = PPO(
        "MlpPolicy", env, seed=0, n_steps=32, batch_size=256, n_epochs=20, gae_lambda=0.8, gamma=0.98, learning_rate=1e-3
    )
    untrained, _ = evaluate_policy(model, env, n_eval_episodes=16, deterministic=False)
    model.learn(20_000)
    trained, _ = evaluate_policy(model, env, n_eval_episodes=16, deterministic=False)
    assert trained > max(150.0, 3 * untrained)


def test_hand_derived_update_runs_under_inference_mode_and_outside_it():
    model = PPO("MlpPolicy", "CartPole-v1", n_steps=16, batch_size=32, n_epochs=2, seed=0)
    model.learn(64)  # train() ran the update under inference mode
    speed = model._ensure_speedups()
    assert isinstance(speed.updater, HandDerivedPPOUpdate)
    sampler = model._sampler(speed)
    model._load_rollout(speed, sampler)
    sampler.shuffle()  # its cached buffers are normal tensors: usable outside inference mode
    minibatch = next(iter(sampler.minibatches()))
    before = [p.detach().clone() for p in model.policy.parameters()]
    speed.updater.forward(minibatch, PPOLossConfig(0.2, None, 0.0, 0.5, 0.5), th.empty(len(STATS)))
    speed.updater.backward()
    speed.updater.optimizer_step(0.5)
    assert not any(p.is_inference() for p in model.policy.parameters())
    assert any(not th.equal(p, q) for p, q in zip(model.policy.parameters(), before, strict=True))
    model.learn(64)  # and back under inference mode


@pytest.mark.parametrize("batch_size", [6, 12])
def test_sampler_draws_the_permutations_sb3_draws(batch_size):
    # SB3 draws np.random.permutation(n) once per epoch; ours must consume numpy's global RNG the same way (also
    # with a single minibatch, whose order it does not use).
    sampler = MinibatchSampler(4, 3, batch_size, th.device("cpu"), None)
    np.random.seed(3)
    ours = []
    for _ in range(3):
        sampler.draw()
        ours.append(sampler.index.clone())
    after = np.random.rand()
    np.random.seed(3)
    stock = [th.from_numpy(env_major_to_time_major(np.random.permutation(12), 4, 3)) for _ in range(3)]
    assert np.random.rand() == after
    for index, expected in zip(ours, stock, strict=True):
        assert th.equal(index, expected)
