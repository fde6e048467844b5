import pickle

import gymnasium as gym
import numpy as np
import pytest
import torch as th
from hypothesis import given, settings
from hypothesis import strategies as st
from stable_baselines3.common.buffers import NStepReplayBuffer

from sb3_speedups.common.replay_buffers import PrioritizedReplayBuffer
from sb3_speedups.common.sum_tree import SumTree

priorities_lists = st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=70)


@settings(max_examples=60, deadline=None)
@given(priorities_lists, st.data())
def test_sum_tree_matches_naive_reference(priorities, data):
    tree = SumTree(len(priorities))
    tree.update(np.arange(len(priorities)), np.array(priorities))
    reference = np.array(priorities)
    n_updates = data.draw(st.integers(0, 10))
    if n_updates:
        idx = np.array(data.draw(st.lists(st.integers(0, len(priorities) - 1), min_size=n_updates, max_size=n_updates)))
        new = np.array(data.draw(st.lists(st.floats(0.0, 100.0), min_size=n_updates, max_size=n_updates)))
        tree.update(idx, new)
        for i, p in zip(idx, new, strict=True):
            reference[i] = p
    np.testing.assert_allclose(tree.get(np.arange(len(priorities))), reference)
    assert tree.total == pytest.approx(reference.sum())
    if reference.sum() > 0:
        values = np.array(data.draw(st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=1, max_size=20)))
        values = values * reference.sum()
        cumulative = np.cumsum(reference)
        expected = np.minimum(np.searchsorted(cumulative, values, side="right"), len(reference) - 1)
        found = tree.find(values)
        assert np.all(reference[found] > 0)
        close = np.isclose(values, cumulative[np.minimum(expected, len(reference) - 1)])
        np.testing.assert_array_equal(found[~close], expected[~close])


def test_sum_tree_sampling_frequencies_follow_priorities():
    rng = np.random.default_rng(0)
    priorities = np.array([1.0, 2.0, 3.0, 4.0, 0.0])
    tree = SumTree(len(priorities))
    tree.update(np.arange(5), priorities)
    counts = np.bincount(tree.find(rng.uniform(0, tree.total, 100_000)), minlength=5)
    np.testing.assert_allclose(counts / counts.sum(), priorities / priorities.sum(), atol=0.01)


def test_sum_tree_rejects_negative_priorities():
    with pytest.raises(ValueError):
        SumTree(3).update(np.array([0]), np.array([-1.0]))


# ----- PrioritizedReplayBuffer ----------------------------------------------------------------------------------------

OBS = gym.spaces.Box(-10, 10, (3,), np.float32)
ACT = gym.spaces.Discrete(2)


def _filled(n: int, n_envs: int = 1, size: int = 16, **kwargs) -> PrioritizedReplayBuffer:
    buffer = PrioritizedReplayBuffer(size, OBS, ACT, device="cpu", n_envs=n_envs, **kwargs)
    for t in range(n):
        obs = np.full((n_envs, 3), t, dtype=np.float32) + np.arange(n_envs, dtype=np.float32)[:, None] / 10
        done = np.array([t % 5 == 4] * n_envs)
        buffer.add(obs, obs + 1, np.full((n_envs, 1), t % 2), np.full(n_envs, float(t)), done, [{} for _ in range(n_envs)])
    return buffer


def test_new_transitions_get_the_max_priority_and_updates_change_it():
    buffer = _filled(4, alpha=0.5)
    np.testing.assert_allclose(buffer.tree.get(np.arange(4)), 1.0)
    buffer.update_priorities(np.array([1]), np.array([8.0]))
    assert buffer.max_priority == pytest.approx((8.0 + 1e-6) ** 0.5)
    buffer.add(np.zeros((1, 3)), np.zeros((1, 3)), np.zeros((1, 1)), np.zeros(1), np.zeros(1), [{}])
    assert buffer.tree.get(np.array([4]))[0] == pytest.approx(buffer.max_priority)


def test_sampling_frequencies_follow_priority_to_the_alpha():
    np.random.seed(0)
    buffer = _filled(8, alpha=0.7)
    td = np.array([0.1, 1.0, 2.0, 4.0, 0.5, 3.0, 0.0, 1.5])
    buffer.update_priorities(np.arange(8), td)
    counts = np.zeros(8)
    for _ in range(2000):
        counts += np.bincount(buffer.sample(32).indices, minlength=8)
    expected = (td + 1e-6) ** 0.7
    np.testing.assert_allclose(counts / counts.sum(), expected / expected.sum(), atol=0.01)


def test_importance_weights_by_hand():
    np.random.seed(1)
    buffer = _filled(6, alpha=1.0, beta=0.5)
    td = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    buffer.update_priorities(np.arange(6), td)
    batch = buffer.sample(4)
    p = (td + 1e-6)[batch.indices] / (td + 1e-6).sum()
    w = (6 * p) ** -0.5
    np.testing.assert_allclose(batch.weights.numpy().reshape(-1), w / w.max(), rtol=1e-5)
    assert batch.weights.shape == (4, 1)
    # the data are the transitions at the sampled leaves
    np.testing.assert_allclose(batch.observations[:, 0].numpy(), batch.indices.astype(np.float32))
    np.testing.assert_allclose(batch.rewards.numpy().reshape(-1), batch.indices.astype(np.float32))


def test_multi_env_leaves_map_to_position_and_env():
    np.random.seed(2)
    buffer = _filled(5, n_envs=3, size=15)
    batch = buffer.sample(64)
    pos, env = batch.indices // 3, batch.indices % 3
    np.testing.assert_allclose(batch.observations[:, 0].numpy(), pos + env / 10, rtol=1e-6)
    assert set(env.tolist()) == {0, 1, 2} and pos.max() < 5


def test_optimize_memory_usage_never_samples_the_invalid_slot():
    np.random.seed(3)
    buffer = _filled(20, size=8, optimize_memory_usage=True, handle_timeout_termination=False)
    for _ in range(50):
        batch = buffer.sample(16)
        assert buffer.pos not in batch.indices.tolist()
        th.testing.assert_close(batch.next_observations, batch.observations + 1)


def test_n_step_returns_equal_stock_n_step_buffer():
    per = _filled(13, size=10, n_steps=3, gamma=0.9)
    stock = NStepReplayBuffer(10, OBS, ACT, device="cpu", n_steps=3, gamma=0.9)
    for t in range(13):
        obs = np.full((1, 3), t, dtype=np.float32)
        stock.add(obs, obs + 1, np.full((1, 1), t % 2), np.full(1, float(t)), np.array([t % 5 == 4]), [{}])
    np.random.seed(4)
    batch = per.sample(8)
    expected = stock._get_samples(batch.indices)  # n_envs=1: leaves are positions
    for name in ("observations", "next_observations", "dones", "rewards", "discounts"):
        th.testing.assert_close(getattr(batch, name), getattr(expected, name), msg=name)
    with pytest.raises(ValueError, match="n_envs=1"):
        PrioritizedReplayBuffer(10, OBS, ACT, n_envs=2, n_steps=3)


def test_pickle_round_trip_keeps_the_tree():
    buffer = _filled(7, alpha=0.6)
    buffer.update_priorities(np.array([2, 3]), np.array([5.0, 0.1]))
    loaded = pickle.loads(pickle.dumps(buffer))
    np.testing.assert_array_equal(loaded.tree.get(np.arange(7)), buffer.tree.get(np.arange(7)))
    assert loaded.max_priority == buffer.max_priority and loaded.pos == buffer.pos


@pytest.mark.parametrize("kwargs", [dict(alpha=-1.0), dict(beta=1.5), dict(epsilon=0.0), dict(n_steps=0)])
def test_bad_arguments_are_refused(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        PrioritizedReplayBuffer(10, OBS, ACT, **kwargs)


def test_stock_sb3_dqn_saves_and_loads_it(tmp_path):
    import stable_baselines3

    model = stable_baselines3.DQN(
        "MlpPolicy", "CartPole-v1", replay_buffer_class=PrioritizedReplayBuffer, learning_starts=50, buffer_size=500
    )
    model.learn(120)
    model.save_replay_buffer(tmp_path / "per")
    model.replay_buffer = None
    model.load_replay_buffer(tmp_path / "per")
    assert isinstance(model.replay_buffer, PrioritizedReplayBuffer) and model.replay_buffer.tree.total > 0
