"""Our DQN: the hand-derived update against autograd, batched sampling, the replay options, the fallbacks."""

import numpy as np
import pytest
import sb3_contrib
import stable_baselines3
import torch as th
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.env_util import make_vec_env
from stable_baselines3.common.envs import SimpleMultiObsEnv
from stable_baselines3.common.evaluation import evaluate_policy
from stable_baselines3.common.type_aliases import ReplayBufferSamples
from gymnasium.spaces import Discrete
from stable_baselines3.common.vec_env import VecFrameStack, VecNormalize

from sb3_speedups import DQN, QRDQN
from sb3_speedups.common.torch_utils import is_channels_last, match_convolutions_to
from sb3_speedups.dqn import q_learning
from sb3_speedups.dqn.update import AutogradQUpdate, HandDerivedQUpdate, huber_
from sb3_speedups.common.replay.sampling import draw_indices, gather, newest_indices, sample_minibatches
from sb3_speedups.dqn.policies import DuelingMlpPolicy, DuelingQNetwork
from sb3_speedups.errors import UserError
from sb3_speedups.registry import get_algo
from tests.algo_cases import DQN_SMALL as SMALL
from tests.space_envs import image_env


def _pair(n_envs: int = 1, steps: int = 700, **extra):
    models = []
    for cls in (DQN, stablebaselines_dqn()):
        env = make_vec_env("CartPole-v1", n_envs=n_envs, seed=3)
        model = cls("MlpPolicy", env, seed=3, **{**SMALL, **extra})
        model.learn(steps)
        models.append(model)
    return models


def stablebaselines_dqn() -> type:
    return stable_baselines3.DQN


def _max_param_diff(a, b) -> float:
    sa, sb = a.policy.state_dict(), b.policy.state_dict()
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


def test_fast_update_matches_autograd_update_with_weights():
    env = make_vec_env("CartPole-v1", n_envs=2, seed=1)
    models = [DQN("MlpPolicy", env, seed=1, fast_update=fast, **SMALL) for fast in (True, False)]
    gen = th.Generator().manual_seed(0)
    obs, target = th.randn(32, 4, generator=gen), th.randn(32, 1, generator=gen)
    actions, weights = th.randint(0, 2, (32, 1), generator=gen), th.rand(32, 1, generator=gen)
    models[1].policy.load_state_dict(models[0].policy.state_dict())
    tds = []
    for model in models:
        updater = model._ensure_speedups().updater
        for _ in range(3):
            td = updater.step(obs, actions, target, weights, 0.5)
            loss = huber_(td, weights)
        tds.append((td, loss))
    assert isinstance(models[0]._speedups.updater, HandDerivedQUpdate)
    assert isinstance(models[1]._speedups.updater, AutogradQUpdate)
    assert _max_param_diff(*models) < 1e-6
    th.testing.assert_close(tds[0][0], tds[1][0])
    th.testing.assert_close(tds[0][1], tds[1][1])


@pytest.mark.parametrize(
    ("n_envs", "n_batches", "strided"), [(3, 4, False), (3, 1, False), (1, 4, False), (1, 1, False), (3, 2, True)]
)
def test_batched_sampling_equals_stock_samples(n_envs: int, n_batches: int, strided: bool):
    ours, _ = _pair(n_envs=n_envs, steps=300)
    buffer = ours.replay_buffer
    if strided:  # storage that is a strided view (ours then indexes it as stock does instead of reshaping it)
        wide = np.zeros((buffer.buffer_size, 2 * n_envs, *buffer.obs_shape), dtype=buffer.observations.dtype)
        wide[:, ::2] = buffer.observations
        buffer.observations = wide[:, ::2]
        assert not buffer.observations.flags.c_contiguous
    np.random.seed(5)
    stock = [buffer.sample(16) for _ in range(n_batches)]
    stock_next_draw = np.random.rand()
    np.random.seed(5)
    batched = sample_minibatches(buffer, 16, n_batches)
    assert np.random.rand() == stock_next_draw  # the global RNG is left where stock leaves it
    for i, field in enumerate(ReplayBufferSamples._fields[:5]):
        expected = th.cat([s[i] for s in stock])
        assert batched[i].dtype == expected.dtype, field
        th.testing.assert_close(batched[i], expected, rtol=0, atol=0, msg=field)


def test_combined_replay_always_holds_the_newest_transitions():
    buffer = ReplayBuffer(7, make_vec_env("CartPole-v1").observation_space, make_vec_env("CartPole-v1").action_space, n_envs=2)
    for t in range(11):  # wraps around
        obs = np.full((2, 4), t, dtype=np.float32)
        buffer.add(obs, obs + 0.5, np.array([[t % 2], [1 - t % 2]]), np.array([t, -t]), np.zeros(2), [{}, {}])
        batch = sample_minibatches(buffer, 5, 3, combined=True)
        obs_rows = batch.observations.reshape(3, 5, 4)
        for k in range(3):
            assert obs_rows[k, 0, 0] == t and obs_rows[k, 1, 0] == t
            assert batch.rewards.reshape(3, 5)[k, 0] == t and batch.rewards.reshape(3, 5)[k, 1] == -t
    draw = newest_indices(buffer)
    assert buffer.full and draw.batch_inds.tolist() == [(11 - 1) % buffer.buffer_size] * 2


def test_combined_replay_trains():
    model = DQN("MlpPolicy", "CartPole-v1", combined_replay=True, seed=0, **SMALL)
    model.learn(400)
    assert model._n_updates > 0


def test_combined_replay_refuses_n_step_buffers():
    with pytest.raises(UserError, match="combined_replay"):
        DQN("MlpPolicy", "CartPole-v1", combined_replay=True, n_steps=3, **SMALL)


def test_double_q_targets_by_hand():
    model = DQN("MlpPolicy", "CartPole-v1", double_q=True, gamma=0.9, seed=0, **SMALL)
    updater = model._ensure_speedups().updater
    gen = th.Generator().manual_seed(1)
    next_obs = th.randn(6, 4, generator=gen)
    data = ReplayBufferSamples(
        th.zeros(6, 4), th.zeros(6, 1), next_obs, th.tensor([[0.0], [1.0], [0.0], [0.0], [1.0], [0.0]]), th.ones(6, 1)
    )
    # Make the target network differ from the online one, so that Double DQN and DQN targets differ.
    with th.no_grad():
        for p in model.q_net_target.parameters():
            p.add_(th.randn(p.shape, generator=gen))
        next_q_target = model.q_net_target(next_obs)
        online = model.q_net(next_obs)
    target = model._targets(data, next_q_target, updater)
    expected = [1.0 + (1 - float(data.dones[i])) * 0.9 * float(next_q_target[i, int(online[i].argmax())]) for i in range(6)]
    np.testing.assert_allclose(target.reshape(-1).numpy(), expected, rtol=1e-5)
    model.double_q = False
    plain = model._targets(data, next_q_target, updater)
    np.testing.assert_allclose(
        plain.reshape(-1).numpy(),
        [1.0 + (1 - float(data.dones[i])) * 0.9 * float(next_q_target[i].max()) for i in range(6)],
        rtol=1e-5,
    )


def test_dueling_heads_by_hand():
    model = DQN("MlpPolicy", "CartPole-v1", seed=0, **{**SMALL, "policy_kwargs": dict(net_arch=[16, 8], dueling=True)})
    assert isinstance(model.policy, DuelingMlpPolicy) and isinstance(model.q_net, DuelingQNetwork)
    assert isinstance(model._ensure_speedups().updater, AutogradQUpdate)
    q_net = model.q_net
    obs = th.randn(5, 4)
    with th.no_grad():
        trunk = q_net.q_net(obs)
        value, adv = q_net.value_stream(trunk), q_net.advantage_stream(trunk)
        th.testing.assert_close(q_net(obs), value + adv - adv.mean(dim=1, keepdim=True))
    assert [m.out_features for m in q_net.value_stream if isinstance(m, th.nn.Linear)] == [8, 1]
    plain = DQN("MlpPolicy", "CartPole-v1", **{**SMALL, "policy_kwargs": dict(net_arch=[16], dueling=False)})
    assert type(plain.policy) is stable_baselines3.dqn.policies.DQNPolicy


def test_multi_env_actions_are_one_batched_greedy_call():
    model = DQN("MlpPolicy", make_vec_env("CartPole-v1", n_envs=4, seed=0), seed=0, **SMALL)
    model.learn(400)
    obs = model.env.reset()
    model._last_obs = obs
    model.exploration_rate = 0.0
    actions, buffer_actions = model._sample_action(learning_starts=0, n_envs=4)
    np.testing.assert_array_equal(actions, model.policy.predict(obs, deterministic=True)[0])
    assert actions.shape == (4,) and buffer_actions is actions


@pytest.mark.parametrize("cls", [DQN, QRDQN])
def test_cnn_actions_are_the_q_networks_greedy_choice_without_predict(cls, monkeypatch):
    """Without the MLP actor (a CNN here) acting calls the Q-network's own forward, not predict's per-call checks: the
    greedy actions are predict's; the exploration draws are stock's (one ``np.random.rand`` per step)."""
    model = cls("CnnPolicy", VecFrameStack(image_env(Discrete(3))(), 4), seed=0, **{**SMALL, "learning_starts": 20})
    model.learn(60)
    assert model._speedups.actor is None and isinstance(model._speedups.updater, AutogradQUpdate)
    model._last_obs = obs = model.env.reset()
    expected = model.policy.predict(obs, deterministic=True)[0]
    model.exploration_rate = 0.0
    monkeypatch.setattr(model.policy, "predict", None)  # not called
    actions, buffer_actions = model._sample_action(learning_starts=0, n_envs=2)
    np.testing.assert_array_equal(actions, expected)
    assert actions.shape == (2,) and buffer_actions is actions
    for rate in (0.0, 1.0):  # greedy or random, numpy's global RNG advances by exactly one draw a step
        model.exploration_rate = rate
        np.random.seed(5)
        draws = [model._sample_action(learning_starts=0, n_envs=2)[0] for _ in range(3)]
        after = np.random.rand()
        np.random.seed(5)
        np.random.rand(3)
        assert after == np.random.rand() and all(d.shape == (2,) for d in draws)


@pytest.mark.parametrize("cls", [DQN, QRDQN])
def test_cnn_weights_take_the_channels_last_order_of_transposed_frames_and_learn_the_same(cls, monkeypatch, tmp_path):
    """SB3's VecTransposeImage hands the CNN channels-last views: the online convolution weights take that order (oneDNN
    runs the same kernels, minus converting the weight at each call), so training computes the same numbers up to
    float32 rounding."""
    kwargs = {**SMALL, "learning_starts": 20, "target_update_interval": 40}

    def learnt(match: bool) -> DQN:
        if not match:
            monkeypatch.setattr(q_learning, "match_convolutions_to", lambda *args: False)
        model = cls("CnnPolicy", VecFrameStack(image_env(Discrete(3))(), 4), seed=0, **kwargs)
        model.learn(120)
        monkeypatch.undo()
        return model

    ordered, plain = learnt(True), learnt(False)

    def convs(model: DQN, target: bool = False) -> list[th.Tensor]:
        head = model._q_head()
        net = head.target_network(model.policy) if target else head.network(model.policy)
        return [m.weight for m in net.modules() if isinstance(m, th.nn.Conv2d)]

    assert convs(ordered) and all(is_channels_last(w) for w in convs(ordered))
    assert not any(is_channels_last(w) for w in convs(ordered, target=True) + convs(plain))
    assert ordered._speedups.updater.optimizer_step.flat.is_bound()
    for (name, a), b in zip(ordered.policy.state_dict().items(), plain.policy.state_dict().values(), strict=True):
        # the same kernels on the same values (targets updated twice, by value), and yet within float32 rounding
        # only: MKL's products round by their operands' memory alignment, which differs between two runs'
        # allocations (the suite run gave 1 ulp on a first-layer weight)
        th.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
    for a, b in zip(ordered.policy.optimizer.state.values(), plain.policy.optimizer.state.values(), strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            th.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-9)  # near-zero entries: cancellation
    # channel-first frames (ALE's vector env) keep the weights as they are: acting then runs stock's kernels
    frames, net = np.zeros((2, 4, 36, 36), dtype=np.uint8), plain._q_head().network(plain.policy)
    assert not match_convolutions_to(net, frames, th.device("cpu"))
    assert match_convolutions_to(net, frames.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2), th.device("cpu"))
    # a save loads into the stock class with the same values
    ordered.save(tmp_path / "model.zip")
    stock = (stable_baselines3.DQN if cls is DQN else sb3_contrib.QRDQN).load(tmp_path / "model.zip")
    for a, b in zip(stock.policy.state_dict().values(), ordered.policy.state_dict().values(), strict=True):
        assert th.equal(a, b)


def test_dict_observations_train_with_the_autograd_update_and_the_flat_adam():
    dict_model = DQN("MultiInputPolicy", SimpleMultiObsEnv(random_start=False), seed=0, **{**SMALL, "learning_starts": 50})
    dict_model.learn(200)
    updater = dict_model._speedups.updater
    assert isinstance(updater, AutogradQUpdate) and dict_model._n_updates > 0
    assert updater.optimizer_step.adam is not None and updater.is_bound()  # one fused Adam step over a flat buffer
    # another optimizer class: its own calls, as stock's
    kwargs = {**SMALL, "learning_starts": 50, "policy_kwargs": dict(net_arch=[32, 32], optimizer_class=th.optim.SGD)}
    sgd = DQN("MultiInputPolicy", SimpleMultiObsEnv(random_start=False), seed=0, **kwargs)
    sgd.learn(200)
    assert sgd._speedups.updater.optimizer_step.adam is None and sgd._n_updates > 0


def test_vecnormalize_env_trains():
    env = VecNormalize(make_vec_env("CartPole-v1", n_envs=2, seed=0))
    norm_model = DQN("MlpPolicy", env, seed=0, **SMALL)
    norm_model.learn(400)
    assert norm_model._n_updates > 0


def test_bad_options_are_refused():
    with pytest.raises(UserError, match="per_final_beta"):
        DQN("MlpPolicy", "CartPole-v1", per_final_beta=2.0)
    with pytest.raises(UserError, match="dueling"):
        DQN("NoSuchPolicy", "CartPole-v1", policy_kwargs=dict(dueling=True))


def test_cli_registry_uses_ours():
    assert get_algo("dqn").cls() is DQN


def test_index_draws_match_sample_with_optimize_memory():
    env = make_vec_env("CartPole-v1", n_envs=2)
    buffer = ReplayBuffer(
        50, env.observation_space, env.action_space, n_envs=2, optimize_memory_usage=True, handle_timeout_termination=False
    )
    obs = env.reset()
    for _ in range(70):
        actions = np.array([env.action_space.sample() for _ in range(2)])
        new_obs, rewards, dones, infos = env.step(actions)
        buffer.add(obs, new_obs, actions, rewards, dones, infos)
        obs = new_obs
    np.random.seed(2)
    stock = buffer.sample(20)
    np.random.seed(2)
    ours = gather(buffer, draw_indices(buffer, 20, 1))
    for a, b in zip(ours[:5], stock[:5], strict=True):
        th.testing.assert_close(a, b)


def test_learns_cartpole():
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        seed=0,
        **{
            **SMALL,
            "batch_size": 64,
            "buffer_size": 20_000,
            "learning_starts": 1000,
            "gradient_steps": 32,
            "exploration_fraction": 0.16,
            "exploration_final_eps": 0.04,
            "policy_kwargs": dict(net_arch=[64, 64]),
        },
    )
    model.learn(10_000)
    mean, _ = evaluate_policy(model, model.get_env(), n_eval_episodes=5)
    assert mean >= 100  # a random policy scores ~20


def test_prioritized_replay_trains_with_weights_and_priorities():
    from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer

    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        seed=0,
        replay_buffer_class=PrioritizedReplayBuffer,
        n_steps=3,
        **{**SMALL, "buffer_size": 600},
    )
    buffer = model.replay_buffer
    assert isinstance(buffer, PrioritizedReplayBuffer) and buffer.n_steps == 3 and model.n_steps == 3
    model.learn(500)
    priorities = buffer.tree.get(np.arange(buffer.pos))
    assert model._n_updates > 0 and len(np.unique(priorities)) > 10  # updated from TD errors
    assert 0.4 < buffer.beta <= 1.0  # annealed towards 1
    combined = DQN(
        "MlpPolicy", "CartPole-v1", seed=0, replay_buffer_class=PrioritizedReplayBuffer, combined_replay=True, **SMALL
    )
    combined.learn(300)
    assert combined._n_updates > 0


def test_bundled_fast_config_and_prioritized_yaml_build_our_options():
    from pathlib import Path

    from sb3_speedups.zoo.envs import make_env
    from sb3_speedups.zoo.train import TrainConfig, create_model, prepare_experiment

    conf = Path(__file__).resolve().parents[1] / "hyperparams" / "dqn_fast.yml"
    for env_id in ("CartPole-v1", "LunarLander-v3", "Acrobot-v1", "MountainCar-v0"):
        experiment = prepare_experiment(TrainConfig("dqn", env_id, n_timesteps=100, seed=0, conf_file=str(conf)))
        model = create_model(experiment, make_env(env_id, experiment.hyperparams, 1, seed=0))
        assert isinstance(model, DQN) and model.double_q and model.n_steps == 3
        model.learn(100)
    overrides = {"replay_buffer_class": "PrioritizedReplayBuffer", "combined_replay": True}
    experiment = prepare_experiment(TrainConfig("dqn", "CartPole-v1", n_timesteps=100, seed=0, hyperparams=overrides))
    model = create_model(experiment, make_env("CartPole-v1", experiment.hyperparams, 1, seed=0))
    assert type(model.replay_buffer).__name__ == "PrioritizedReplayBuffer" and model.combined_replay


def test_hand_derived_update_runs_under_inference_mode_and_outside_it():
    model = DQN("MlpPolicy", "CartPole-v1", learning_starts=32, train_freq=4, gradient_steps=2, batch_size=16, seed=0)
    model.learn(128)  # train() ran the update under inference mode
    updater = model._ensure_speedups().updater
    assert isinstance(updater, HandDerivedQUpdate)
    obs = th.zeros(16, 4)
    q = updater.q_values(obs)  # reuses the forward buffers outside inference mode
    td = updater.step(obs, th.zeros(16, 1, dtype=th.long), q[:, :1].detach().clone() + 1.0, None, 10.0)
    assert td.shape == (16, 1) and not any(p.is_inference() for p in model.policy.parameters())
    model.learn(128)


def _threads_seen_in_train(model) -> list[int]:
    seen: list[int] = []
    updater = model._ensure_speedups().updater
    step = updater.step

    def recording_step(*args, **kwargs):
        seen.append(th.get_num_threads())
        return step(*args, **kwargs)

    updater.step = recording_step
    return seen


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
@pytest.mark.parametrize("net_arch, num_threads, expected", [([256, 256], None, 2), ([32, 32], None, 1), ([256, 256], 1, 1)])
def test_update_threads_follow_the_size_of_the_matrix_products(net_arch, num_threads, expected, torch_threads_restored):
    from sb3_speedups.common import torch_utils

    env = make_vec_env("CartPole-v1", n_envs=1, seed=0)
    extra = dict(policy_kwargs=dict(net_arch=net_arch), batch_size=64, learning_starts=100, gradient_steps=4)
    model = DQN("MlpPolicy", env, seed=0, num_threads=num_threads, **{**SMALL, **extra})
    assert th.get_num_threads() == 1  # acting runs on one thread either way
    seen = _threads_seen_in_train(model)
    model.learn(300)
    assert seen and set(seen) == {expected}
    assert th.get_num_threads() == 1  # restored after every train()
    # A count the user set themselves is never changed (3: neither torch's start-up value here nor our default).
    th.set_num_threads(3)
    assert torch_utils.update_num_threads(10**9, None, th.device("cpu")) is None
