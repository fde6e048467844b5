"""GAE as a pure function, the preallocated rollout buffers, and per-epoch minibatches, against plain references."""

import numpy as np
import pytest
import torch as th
from gymnasium import spaces
from hypothesis import given, settings
from hypothesis import strategies as st
from stable_baselines3.common.buffers import DictRolloutBuffer, RolloutBuffer

from sb3_speedups.common.on_policy.timeouts import Timeouts
from sb3_speedups.common.on_policy.buffers import FastDictRolloutBuffer, FastRolloutBuffer, compute_gae
from sb3_speedups.ppo.minibatches import ADVANTAGES, MinibatchSampler, normalize_chunks_


def reference_gae(rewards, values, terminated, truncated, terminal_values, last_values, gamma, lam):
    """
    Textbook GAE, one env and one step at a time, with explicit episode ends: ``terminated[t]`` / ``truncated[t]``
    say that step t ended the episode; a truncated step bootstraps from ``terminal_values[t]``.
    """
    n_steps, n_envs = rewards.shape
    adv = np.zeros((n_steps, n_envs))
    for env in range(n_envs):
        running = 0.0
        for t in reversed(range(n_steps)):
            if terminated[t, env]:
                delta, running = rewards[t, env] - values[t, env], 0.0
            elif truncated[t, env]:
                delta, running = rewards[t, env] + gamma * terminal_values[t, env] - values[t, env], 0.0
            else:
                next_value = last_values[env] if t == n_steps - 1 else values[t + 1, env]
                delta = rewards[t, env] + gamma * next_value - values[t, env]
            running = delta + gamma * lam * running
            adv[t, env] = running
    return adv


def random_rollout(rng, n_steps=17, n_envs=5):
    rewards = rng.normal(size=(n_steps, n_envs)).astype(np.float32)
    values = rng.normal(size=(n_steps, n_envs)).astype(np.float32)
    ends = rng.random((n_steps, n_envs)) < 0.15
    truncated = ends & (rng.random((n_steps, n_envs)) < 0.5)
    terminated = ends & ~truncated
    terminal_values = rng.normal(size=(n_steps, n_envs)).astype(np.float32)
    last_values = rng.normal(size=n_envs).astype(np.float32)
    return rewards, values, terminated, truncated, terminal_values, last_values


@pytest.mark.parametrize("gamma,lam", [(0.99, 0.95), (0.98, 0.8), (1.0, 1.0), (0.9, 0.0)])
def test_compute_gae_matches_reference_loop_with_truncation(gamma, lam):
    rng = np.random.default_rng(0)
    rewards, values, terminated, truncated, terminal_values, last_values = random_rollout(rng)
    ends = terminated | truncated
    # SB3's convention: episode_starts[t] says step t-1 ended an episode; truncation adds gamma * V(terminal obs).
    episode_starts = np.zeros_like(rewards)
    episode_starts[1:] = ends[:-1]
    bootstrapped = rewards + gamma * terminal_values * truncated
    adv = compute_gae(bootstrapped, values, episode_starts, last_values, ends[-1], gamma, lam)
    expected = reference_gae(rewards, values, terminated, truncated, terminal_values, last_values, gamma, lam)
    assert truncated.any() and terminated.any()
    np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(
    n_steps=st.integers(1, 12),
    n_envs=st.integers(1, 4),
    gamma=st.floats(0.0, 1.0),
    lam=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_compute_gae_equals_stock_rollout_buffer_bitwise(n_steps, n_envs, gamma, lam, seed):
    rng = np.random.default_rng(seed)
    rewards, values, terminated, truncated, _, last_values = random_rollout(rng, n_steps, n_envs)
    dones = (terminated | truncated)[-1]
    episode_starts = (rng.random((n_steps, n_envs)) < 0.2).astype(np.float32)
    stock = RolloutBuffer(n_steps, spaces.Box(-1, 1, (1,)), spaces.Discrete(2), gamma=gamma, gae_lambda=lam, n_envs=n_envs)
    stock.rewards, stock.values, stock.episode_starts = rewards, values, episode_starts
    stock.compute_returns_and_advantage(th.as_tensor(last_values), dones)
    adv = compute_gae(rewards, values, episode_starts, last_values, dones, gamma, lam)
    np.testing.assert_array_equal(adv, stock.advantages)


def fill(buffer, rng, n_steps, n_envs, dict_obs=False):
    for _ in range(n_steps):
        if dict_obs:
            obs = {"a": rng.normal(size=(n_envs, 3)).astype(np.float32), "b": rng.integers(0, 4, size=n_envs)}
        else:
            obs = rng.normal(size=(n_envs, 3)).astype(np.float32)
        buffer.add(
            obs,
            rng.integers(0, 2, size=(n_envs, 1)),
            rng.normal(size=n_envs).astype(np.float32),
            (rng.random(n_envs) < 0.2).astype(np.float32),
            th.as_tensor(rng.normal(size=(n_envs, 1)).astype(np.float32)),
            th.as_tensor(rng.normal(size=n_envs).astype(np.float32)),
        )


@pytest.mark.parametrize("dict_obs", [False, True])
def test_fast_buffer_is_a_drop_in_rollout_buffer(dict_obs):
    n_steps, n_envs = 6, 3
    if dict_obs:
        obs_space = spaces.Dict({"a": spaces.Box(-5, 5, (3,)), "b": spaces.Discrete(4)})
        classes = (DictRolloutBuffer, FastDictRolloutBuffer)
    else:
        obs_space = spaces.Box(-5, 5, (3,))
        classes = (RolloutBuffer, FastRolloutBuffer)
    buffers = [cls(n_steps, obs_space, spaces.Discrete(2), gamma=0.9, gae_lambda=0.7, n_envs=n_envs) for cls in classes]
    for buffer in buffers:
        fill(buffer, np.random.default_rng(1), n_steps, n_envs, dict_obs)
        buffer.compute_returns_and_advantage(th.ones(n_envs), np.array([True, False, False]))
    stock, fast = buffers
    np.testing.assert_array_equal(fast.advantages, stock.advantages)
    np.testing.assert_array_equal(fast.returns, stock.returns)
    samples = []
    for buffer in buffers:
        np.random.seed(3)
        samples.append(list(buffer.get(batch_size=5)))
    assert len(samples[0]) == len(samples[1]) == 4
    for a, b in zip(*samples, strict=True):
        for x, y in zip(a, b, strict=True):
            if isinstance(x, dict):
                for key in x:
                    th.testing.assert_close(y[key], x[key])
            else:
                th.testing.assert_close(y, x)
    # get() must not rearrange the storage: a second pass and reset keep working
    assert len(list(fast.get(batch_size=None))) == 1
    fast.reset()
    assert fast.pos == 0 and not fast.full


def test_recompute_with_new_values_rebootstraps_timeouts():
    n_steps, n_envs, gamma = 4, 2, 0.9
    buffer = FastRolloutBuffer(
        n_steps, spaces.Box(-5, 5, (3,)), spaces.Discrete(2), gamma=gamma, gae_lambda=0.8, n_envs=n_envs
    )
    rng = np.random.default_rng(2)
    fill(buffer, rng, n_steps - 1, n_envs)
    # a truncation in env 1 at the last step: its reward already holds gamma * V(terminal) = gamma * 2
    buffer.add_timeouts(Timeouts(np.array([1]), np.zeros((1, 3), np.float32), np.array([gamma * 2.0], np.float32)))
    fill(buffer, rng, 1, n_envs)
    buffer.compute_returns_and_advantage(th.zeros(n_envs), np.array([False, True]))
    before = buffer.advantages.copy()
    # Same values again: nothing changes.
    buffer.recompute_returns_and_advantage(buffer.values.copy(), np.zeros(n_envs), [np.array([2.0])])
    np.testing.assert_allclose(buffer.advantages, before, atol=1e-6)
    # A new terminal value moves only that env's advantages, by gamma * (new - old) * (gamma lambda)^k.
    buffer.recompute_returns_and_advantage(buffer.values.copy(), np.zeros(n_envs), [np.array([3.0])])
    np.testing.assert_allclose(buffer.advantages[:, 0], before[:, 0], atol=1e-6)
    assert buffer.advantages[-1, 1] == pytest.approx(before[-1, 1] + gamma * 1.0, abs=1e-5)


def test_normalize_chunks_is_per_minibatch_normalisation():
    x = th.randn(23)
    expected = []
    for start in range(0, 23, 8):
        part = x[start : start + 8]
        expected.append((part - part.mean()) / (part.std() + 1e-8) if len(part) > 1 else part)
    y = x.clone()
    normalize_chunks_(y, 8)
    th.testing.assert_close(y, th.cat(expected))
    z = th.tensor([1.0, 2.0, 3.0])  # a last chunk of one sample stays as is
    normalize_chunks_(z, 2)
    assert z[2] == 3.0


@pytest.mark.parametrize("normalize", ["minibatch", "batch"])
def test_sampler_serves_stock_minibatches(normalize):
    n_steps, n_envs, batch = 5, 4, 6
    buffer = FastRolloutBuffer(n_steps, spaces.Box(-5, 5, (3,)), spaces.Discrete(2), n_envs=n_envs)
    fill(buffer, np.random.default_rng(4), n_steps, n_envs)
    buffer.compute_returns_and_advantage(th.zeros(n_envs), np.zeros(n_envs, dtype=bool))
    sampler = MinibatchSampler(n_steps, n_envs, batch, th.device("cpu"), normalize=normalize)
    scalars = th.stack([buffer.flat(k) for k in ("values", "log_probs", "advantages", "returns")])
    sampler.load(buffer.flat_observations(), {"actions": buffer.flat("actions")}, scalars)
    np.random.seed(7)
    stock = list(buffer.get(batch))
    np.random.seed(7)
    sampler.shuffle()
    ours = list(sampler.minibatches())
    assert [len(b.returns) for b in ours] == [6, 6, 6, 2]
    for mine, ref in zip(ours, stock, strict=True):
        th.testing.assert_close(mine.observations, ref.observations)
        th.testing.assert_close(mine.actions["actions"], ref.actions)
        th.testing.assert_close(mine.returns, ref.returns)
        if normalize == "minibatch":
            th.testing.assert_close(mine.advantages, (ref.advantages - ref.advantages.mean()) / (ref.advantages.std() + 1e-8))
    if normalize == "batch":
        adv = sampler.epoch_scalars[ADVANTAGES]
        assert abs(float(adv.mean())) < 1e-5 and float(adv.std()) == pytest.approx(1.0, abs=1e-4)
