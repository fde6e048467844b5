"""Our PPO against stock SB3's: same first rollout, same gradients, interchangeable saves, every space, callbacks."""

import json
import zipfile

import gymnasium as gym
import numpy as np
import pytest
import stable_baselines3
import torch as th
from gymnasium import spaces
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import SimpleMultiObsEnv
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.policies import ActorCriticPolicy
from stable_baselines3.common.vec_env import VecNormalize

from sb3_speedups import PPO
from sb3_speedups.common.nn.heads import make_head
from sb3_speedups.ppo.buffers import env_major_to_time_major
from sb3_speedups.ppo.minibatches import Minibatch, MinibatchSampler
from sb3_speedups.ppo.update import STATS, AutogradPPOUpdate, ManualPPOUpdate, PPOLossConfig
from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo


class BoxObsEnv(gym.Env):
    """
    A small real env with ``Box`` observations (flat floats, or a uint8 image) for any action space; episodes are
    cut by a time limit.
    """

    def __init__(self, action_space: spaces.Space, episode_length: int = 12, image: bool = False) -> None:
        self.image = image
        if image:
            self.observation_space = spaces.Box(0, 255, (36, 36, 1), np.uint8)
        else:
            self.observation_space = spaces.Box(-1, 1, (4,), np.float32)
        self.action_space = action_space
        self.episode_length = episode_length

    def _observe(self):
        if self.image:
            return self.np_random.integers(0, 256, (36, 36, 1), dtype=np.uint8)
        return self.np_random.uniform(-1, 1, 4).astype(np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.state = self._observe()
        return self.state, {}

    def step(self, action):
        self.t += 1
        target = float(self.state.mean()) if self.image else float(self.state.sum())
        reward = -abs(float(np.asarray(action, dtype=np.float32).sum()) - target)
        self.state = self._observe()
        return self.state, reward, False, self.t >= self.episode_length, {}


ACTION_SPACES = {
    "discrete": spaces.Discrete(3),
    "box": spaces.Box(-1, 1, (2,), np.float32),
    "multidiscrete": spaces.MultiDiscrete([3, 2]),
    "multibinary": spaces.MultiBinary(3),
}
SMALL = dict(n_steps=16, batch_size=32, n_epochs=2)


def box_env(name, n_envs=4, seed=0):
    return make_vec_env(lambda: BoxObsEnv(ACTION_SPACES[name]), n_envs=n_envs, seed=seed)


def first_rollout(cls, env, policy="MlpPolicy", **kwargs):
    model = cls(policy, env, seed=3, **SMALL, **kwargs)
    _, callback = model._setup_learn(10_000, None)
    assert model.collect_rollouts(model.env, callback, model.rollout_buffer, model.n_steps)
    buffer = model.rollout_buffer
    names = ("observations", "actions", "rewards", "episode_starts", "values", "log_probs", "advantages", "returns")
    if isinstance(buffer.observations, dict):
        return {
            **{f"obs.{k}": np.array(v, np.float64) for k, v in buffer.observations.items()},
            **{name: np.array(getattr(buffer, name), dtype=np.float64) for name in names[1:]},
        }
    return {name: np.array(getattr(buffer, name), dtype=np.float64) for name in names}


def rollout_case(name):
    """:return: (env factory, policy, extra kwargs of ours) of a first-rollout case"""
    if name.startswith("cartpole"):  # a short time limit: truncations bootstrap from the terminal value
        env = lambda: make_vec_env(lambda: gym.make("CartPole-v1", max_episode_steps=10), n_envs=4, seed=1)  # noqa: E731
        return env, "MlpPolicy", {"fast_update": False} if name == "cartpole_fallback" else {}
    if name == "box_sde":
        return lambda: box_env("box"), "MlpPolicy", {"use_sde": True, "sde_sample_freq": 4}
    if name == "dict":
        return lambda: make_vec_env(lambda: SimpleMultiObsEnv(random_start=True), n_envs=2, seed=1), "MultiInputPolicy", {}
    if name == "image":
        return lambda: make_vec_env(lambda: BoxObsEnv(spaces.Discrete(3), image=True), n_envs=2, seed=1), "CnnPolicy", {}
    return lambda: box_env(name), "MlpPolicy", {}


@pytest.mark.parametrize("name", [*ACTION_SPACES, "cartpole", "cartpole_fallback", "box_sde", "dict", "image"])
def test_first_rollout_equals_stock(name):
    env, policy, kwargs = rollout_case(name)
    stock_kwargs = {k: v for k, v in kwargs.items() if k in ("use_sde", "sde_sample_freq")}
    np.random.seed(0)  # SimpleMultiObsEnv draws its observations from numpy's global RNG when created
    stock = first_rollout(stable_baselines3.PPO, env(), policy, **stock_kwargs)
    np.random.seed(0)
    ours = first_rollout(PPO, env(), policy, **kwargs)
    assert stock["episode_starts"].sum() > 0 or name == "dict"
    # Continuous actions (mean + std * noise) are equal up to float32 rounding: ours acts through numpy's matrix
    # products, stock through torch's. Sampled discrete actions must be identical.
    exact = ["episode_starts"] + (["actions"] if name != "box" else [])
    for key in [k for k in stock if k.startswith("obs")] + exact:
        np.testing.assert_array_equal(ours[key], stock[key], err_msg=key)
    np.testing.assert_allclose(ours["actions"], stock["actions"], rtol=0, atol=1e-6, err_msg="actions")
    for key in ("values", "log_probs", "rewards", "advantages", "returns"):
        np.testing.assert_allclose(ours[key], stock[key], rtol=0, atol=1e-5, err_msg=key)


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
    manual, autograd = ManualPPOUpdate(ours, head), AutogradPPOUpdate(stock)
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
    host, device = (ManualPPOUpdate(p, head) for p in policies)
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
    manual = ManualPPOUpdate(ours, make_head(ours.action_dist, action_space))
    autograd = AutogradPPOUpdate(stock)
    manual.forward(Minibatch(obs, manual.training_actions(actions), *args), cfg, th.empty(len(STATS)))
    manual.backward()
    autograd.forward(Minibatch(obs, {"actions": actions}, *args), cfg, th.empty(len(STATS)))
    autograd.backward()
    for p, q in zip(ours.parameters(), stock.parameters(), strict=True):
        th.testing.assert_close(manual.flat.grad_of(p), q.grad, rtol=1e-4, atol=1e-6)


class Counter(BaseCallback):
    def __init__(self):
        super().__init__()
        self.steps = self.starts = self.ends = 0
        self.keys: set[str] = set()

    def _on_rollout_start(self):
        self.starts += 1

    def _on_step(self):
        self.steps += 1
        self.keys |= set(self.locals)
        return True

    def _on_rollout_end(self):
        self.ends += 1


@pytest.mark.parametrize("name", ACTION_SPACES)
@pytest.mark.parametrize("fast_update", [True, False])
def test_learn_every_action_space_fast_and_fallback(name, fast_update):
    model = PPO("MlpPolicy", box_env(name), seed=0, fast_update=fast_update, **SMALL)
    before = [p.detach().clone() for p in model.policy.parameters()]
    counter = Counter()
    model.learn(128, callback=counter)
    assert (model.fast_path_unsupported_reason() is None) == fast_update
    assert isinstance(model._speedups.updater, ManualPPOUpdate if fast_update else AutogradPPOUpdate)
    assert counter.steps == 128 // 4 and counter.starts == counter.ends == 2
    assert {"infos", "dones", "rewards", "new_obs", "actions", "values", "log_probs", "self"} <= counter.keys
    assert all(not th.equal(p, q) for p, q in zip(model.policy.parameters(), before, strict=True))
    assert np.isfinite(model.logger.name_to_value["train/value_loss"])


def test_callbacks_see_what_stock_callbacks_see():
    counters = []
    for cls in (stable_baselines3.PPO, PPO):
        counter = Counter()
        cls("MlpPolicy", box_env("discrete"), seed=0, **SMALL).learn(96, callback=counter)
        counters.append(counter)
    stock, ours = counters
    assert (ours.steps, ours.starts, ours.ends) == (stock.steps, stock.starts, stock.ends)
    loop_temporaries = {"obs_tensor", "done", "idx", "terminal_obs", "terminal_value"}
    assert stock.keys - loop_temporaries <= ours.keys


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


def test_save_load_both_ways_with_stock(tmp_path):
    ours = PPO("MlpPolicy", box_env("box"), seed=0, **SMALL).learn(128)
    ours.save(tmp_path / "ours.zip")
    with zipfile.ZipFile(tmp_path / "ours.zip") as archive:
        data = json.loads(archive.read("data"))
    assert "_speedups" not in data and "rollout_buffer" not in data
    stock = stable_baselines3.PPO.load(tmp_path / "ours.zip", env=box_env("box"))
    obs = box_env("box").reset()
    np.testing.assert_allclose(stock.predict(obs, deterministic=True)[0], ours.predict(obs, deterministic=True)[0], atol=1e-6)
    stock.learn(64)  # stock keeps training our file

    stock.save(tmp_path / "stock.zip")
    steps = {float(s["step"]) for s in stock.policy.optimizer.state.values()}
    loaded = PPO.load(tmp_path / "stock.zip", env=box_env("box"))
    loaded.learn(64, reset_num_timesteps=False)
    assert loaded.fast_path_unsupported_reason() is None
    assert {float(s["step"]) for s in loaded.policy.optimizer.state.values()} == {max(steps) + 4}  # 2 epochs x 2 batches
    assert loaded.num_timesteps == stock.num_timesteps + 64


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


def test_batch_normalisation_target_kl_and_bad_input():
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
    assert isinstance(speed.updater, ManualPPOUpdate)
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
