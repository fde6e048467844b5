"""Fast RecurrentPPO: one-call sequence pass equals sb3-contrib's, LSTM/GRU, save/load both ways, learning."""

from __future__ import annotations

import numpy as np
import pytest
import sb3_contrib
import torch as th
from sb3_contrib.common.recurrent.policies import RecurrentActorCriticPolicy as StockPolicy
from torch import nn

import sb3_speedups.envs  # noqa: F401  (registers DelayedRecall-v0)
from sb3_speedups import RecurrentPPO
from sb3_speedups.ppo_recurrent.policies import process_sequence

KW = dict(n_steps=32, batch_size=64, n_epochs=2, policy_kwargs=dict(lstm_hidden_size=16, net_arch=[16]), seed=0)


def _batch(n_seq: int = 5, seq_len: int = 7, dim: int = 3) -> tuple[th.Tensor, th.Tensor, tuple[th.Tensor, th.Tensor]]:
    gen = th.Generator().manual_seed(0)
    features = th.randn(n_seq * seq_len, dim, generator=gen)
    starts = th.zeros(n_seq, seq_len)
    starts[::2, 0] = 1.0
    states = (th.randn(1, n_seq, 8, generator=gen), th.randn(1, n_seq, 8, generator=gen))
    return features, starts.flatten(), states


@pytest.mark.parametrize("mid_episode_start", [False, True])
def test_process_sequence_matches_sb3_contrib_lstm(mid_episode_start: bool) -> None:
    features, starts, states = _batch()
    if mid_episode_start:
        starts[10] = 1.0
    lstm = nn.LSTM(3, 8)
    ours, ours_states = process_sequence(features, states, starts, lstm)
    stock, stock_states = StockPolicy._process_sequence(features, states, starts, lstm)
    th.testing.assert_close(ours, stock)
    th.testing.assert_close(ours_states[0], stock_states[0])
    th.testing.assert_close(ours_states[1], stock_states[1])


def test_gru_sequence_equals_step_by_step() -> None:
    features, starts, states = _batch(n_seq=1, seq_len=12)
    starts[5] = 1.0
    gru = nn.GRU(3, 8)
    whole, whole_states = process_sequence(features, states, starts, gru)
    # Split the sequence in two chunks, carrying the state across: same outputs.
    first, mid = process_sequence(features[:6], states, starts[:6], gru)
    second, end = process_sequence(features[6:], mid, starts[6:], gru)
    th.testing.assert_close(whole, th.cat([first, second]))
    th.testing.assert_close(whole_states[0], end[0])


def test_evaluate_actions_matches_sb3_contrib_on_rollout_batch() -> None:
    ours = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", **KW)
    ours.learn(64)
    stock = sb3_contrib.RecurrentPPO("MlpLstmPolicy", "CartPole-v1", **KW)
    stock.policy.load_state_dict(ours.policy.state_dict())
    for batch in ours.rollout_buffer.get(16):
        args = (batch.observations, batch.actions, batch.lstm_states, batch.episode_starts)
        with th.no_grad():
            values, log_prob, entropy = ours.policy.evaluate_actions(*args)
            ref = stock.policy.evaluate_actions(*args)
        th.testing.assert_close(values, ref[0])
        th.testing.assert_close(log_prob, ref[1])
        th.testing.assert_close(entropy, ref[2])


@pytest.mark.parametrize("policy", ["MlpLstmPolicy", "MlpGruPolicy"])
def test_predict_with_state(policy: str) -> None:
    model = RecurrentPPO(policy, "CartPole-v1", **KW)
    env = model.get_env()
    assert env is not None
    obs = env.reset()
    state = None
    starts = np.ones(env.num_envs, dtype=bool)
    for _ in range(5):
        action, state = model.predict(obs, state=state, episode_start=starts, deterministic=True)
        obs, _, dones, _ = env.step(action)
        starts = dones
    assert state is not None and state[0].shape == (1, env.num_envs, 16)


def test_gru_has_fewer_parameters() -> None:
    lstm = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", **KW)
    gru = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", **{**KW, "policy_kwargs": {**KW["policy_kwargs"], "rnn_type": "gru"}})
    count = lambda m: sum(p.numel() for p in m.policy.parameters())  # noqa: E731
    assert isinstance(gru.policy.lstm_actor, nn.GRU)
    assert count(gru) < count(lstm)
    assert sum(p.numel() for g in gru.policy.optimizer.param_groups for p in g["params"]) == count(gru)


def test_save_load_both_ways_with_sb3_contrib(tmp_path) -> None:
    ours = RecurrentPPO("MlpLstmPolicy", "CartPole-v1", **KW)
    ours.save(tmp_path / "ours")
    stock = sb3_contrib.RecurrentPPO.load(tmp_path / "ours")
    assert type(stock.policy) is StockPolicy
    stock.save(tmp_path / "stock")
    back = RecurrentPPO.load(tmp_path / "stock")
    assert type(back.policy) is not StockPolicy and isinstance(back.policy, StockPolicy)
    for a, b in zip(ours.policy.state_dict().values(), back.policy.state_dict().values(), strict=True):
        th.testing.assert_close(a, b)
    gru = RecurrentPPO("MlpGruPolicy", "CartPole-v1", **KW)
    gru.save(tmp_path / "gru")
    assert isinstance(RecurrentPPO.load(tmp_path / "gru").policy.lstm_actor, nn.GRU)


def test_delayed_recall_chance_for_random_and_solvable_signal() -> None:
    import gymnasium as gym

    env = gym.make("DelayedRecall-v0", delay=3)
    obs, _ = env.reset(seed=1)
    cue = int(obs[0] > 0)
    for t in range(3):
        obs, reward, terminated, _, _ = env.step(0)
        assert reward == 0.0 and not terminated
        assert obs[1] == (1.0 if t == 2 else 0.0)
    _, reward, terminated, _, _ = env.step(cue)
    assert reward == 1.0 and terminated


@pytest.mark.slow
def test_short_learning_cartpole() -> None:
    model = RecurrentPPO(
        "MlpLstmPolicy",
        "CartPole-v1",
        n_steps=64,
        batch_size=128,
        learning_rate=3e-3,
        n_epochs=5,
        policy_kwargs=dict(lstm_hidden_size=32, net_arch=[32]),
        seed=0,
    )
    model.learn(6000)
    returns = [ep["r"] for ep in model.ep_info_buffer]
    assert np.mean(returns[-10:]) > 40


@pytest.mark.slow
def test_memory_task_solved_by_lstm_and_gru_not_by_feed_forward() -> None:
    from stable_baselines3.common.env_util import make_vec_env

    from sb3_speedups import PPO

    kw = dict(n_steps=32, batch_size=64, n_epochs=10, learning_rate=3e-3, ent_coef=0.01, seed=0)
    rnn_kwargs = dict(lstm_hidden_size=32, net_arch=dict(pi=[32], vf=[32]))
    cases = [
        (RecurrentPPO, "MlpLstmPolicy", rnn_kwargs),
        (RecurrentPPO, "MlpGruPolicy", rnn_kwargs),
        (PPO, "MlpPolicy", dict(net_arch=[32])),
    ]
    means = []
    for algo, policy, policy_kwargs in cases:
        env = make_vec_env("DelayedRecall-v0", n_envs=8, seed=0, env_kwargs=dict(delay=3))
        model = algo(policy, env, policy_kwargs=policy_kwargs, **kw)
        model.learn(5000)
        means.append(np.mean([ep["r"] for ep in model.ep_info_buffer][-50:]))
    lstm, gru, feed_forward = means
    assert lstm > 0.8 and gru > 0.8
    assert feed_forward < 0.5
