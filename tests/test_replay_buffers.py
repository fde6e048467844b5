import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torch as th
from gymnasium import spaces
from stable_baselines3 import DQN
from stable_baselines3.common.buffers import NStepReplayBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from sb3_speedups.dqn.replay.buffers import PrioritizedReplayBuffer, PrioritizedReplayBufferSamples, newest_indices
from sb3_speedups.dqn.replay.sum_tree import SumTree

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


# ---------------------------------------------------------------- prioritised replay


OBS_SPACE = spaces.Box(-np.inf, np.inf, (2,), np.float32)
ACT_SPACE = spaces.Discrete(2)


def _fill(buffer: ReplayBuffer, n_adds: int, done_every: int = 0, timeout_every: int = 0) -> None:
    """Add ``n_adds`` steps whose observation encodes (step, env) and whose reward is ``step + env / 10``."""
    n_envs = buffer.n_envs
    env_ids = np.arange(n_envs, dtype=np.float32)
    for t in range(n_adds):
        obs = np.stack([np.full(n_envs, t, np.float32), env_ids], axis=1)
        next_obs = obs + np.array([1.0, 0.0], np.float32)
        done = np.full(n_envs, float(done_every and t % done_every == done_every - 1), np.float32)
        truncated = bool(timeout_every and t % timeout_every == timeout_every - 1)
        infos = [{"TimeLimit.truncated": truncated} for _ in range(n_envs)]
        buffer.add(obs, next_obs, np.zeros(n_envs), t + env_ids / 10, np.maximum(done, truncated), infos)


def test_samples_keep_replay_buffer_samples_fields_in_order():
    fields = PrioritizedReplayBufferSamples._fields
    assert fields[: len(ReplayBufferSamples._fields)] == ReplayBufferSamples._fields
    assert fields[len(ReplayBufferSamples._fields) :] == ("weights", "indices")


@pytest.mark.parametrize("kwargs", [{"alpha": -0.1}, {"beta": -1.0}, {"epsilon": 0.0}, {"n_steps": 0}, {"gamma": 1.5}])
def test_invalid_arguments_name_the_bad_value(kwargs):
    name, value = next(iter(kwargs.items()))
    with pytest.raises(ValueError, match=f"{name}={value}"):
        PrioritizedReplayBuffer(10, OBS_SPACE, ACT_SPACE, **kwargs)


@pytest.mark.parametrize("n_envs", [1, 3])
def test_sampling_frequencies_proportional_to_priority_alpha(n_envs):
    np.random.seed(0)
    alpha = 0.7
    buffer = PrioritizedReplayBuffer(8 * n_envs, OBS_SPACE, ACT_SPACE, device="cpu", n_envs=n_envs, alpha=alpha)
    _fill(buffer, 8)
    leaves = np.arange(8 * n_envs)
    td_errors = (leaves % 5).astype(np.float64)
    buffer.update_priorities(leaves, td_errors)
    counts = np.zeros(leaves.size)
    for _ in range(200):
        samples = buffer.sample(256)
        counts += np.bincount(samples.indices, minlength=leaves.size)
        # the sampled observation is the one stored at that (position, env) leaf
        np.testing.assert_array_equal(samples.observations[:, 0].numpy(), samples.indices // n_envs)
        np.testing.assert_array_equal(samples.observations[:, 1].numpy(), samples.indices % n_envs)
    expected = (td_errors + buffer.epsilon) ** alpha
    expected /= expected.sum()
    np.testing.assert_allclose(counts / counts.sum(), expected, atol=0.006)


def test_importance_weights_match_hand_computation():
    buffer = PrioritizedReplayBuffer(4, OBS_SPACE, ACT_SPACE, device="cpu", alpha=1.0, beta=0.5, epsilon=1e-6)
    _fill(buffer, 4)
    buffer.update_priorities(np.arange(4), np.array([1.0, 2.0, 3.0, 4.0]) - 1e-6)
    samples = buffer.sample(4)
    p = np.array([1.0, 2.0, 3.0, 4.0])[samples.indices]
    w = (4 * p / 10.0) ** -0.5
    np.testing.assert_allclose(samples.weights.numpy().ravel(), w / w.max(), rtol=1e-5)
    assert samples.weights.shape == (4, 1)
    buffer.beta = 1.0
    samples = buffer.sample(4)
    p = np.array([1.0, 2.0, 3.0, 4.0])[samples.indices]
    np.testing.assert_allclose(samples.weights.numpy().ravel(), p.min() / p, rtol=1e-5)


def test_new_transitions_get_max_priority_and_updates_change_sampling():
    np.random.seed(1)
    buffer = PrioritizedReplayBuffer(10, OBS_SPACE, ACT_SPACE, device="cpu", alpha=1.0)
    _fill(buffer, 3)
    np.testing.assert_allclose(buffer.tree.get(np.arange(3)), 1.0)
    buffer.update_priorities(np.array([0, 1, 2]), th.tensor([0.0, 0.0, 5.0]))
    assert buffer.max_priority == pytest.approx(5.0 + 1e-6)
    counts = np.bincount(buffer.sample(1000).indices, minlength=3)
    assert counts[2] > 990
    _fill(buffer, 1)
    assert buffer.tree.get(np.array([3]))[0] == pytest.approx(5.0 + 1e-6)


@pytest.mark.parametrize("n_envs", [1, 3])
def test_optimize_memory_usage_never_samples_the_overwritten_slot(n_envs):
    np.random.seed(2)
    buffer = PrioritizedReplayBuffer(
        6 * n_envs,
        OBS_SPACE,
        ACT_SPACE,
        device="cpu",
        n_envs=n_envs,
        optimize_memory_usage=True,
        handle_timeout_termination=False,
    )
    _fill(buffer, 9)  # full, pos == 3: the transitions at slot 3 have lost their observations
    samples = buffer.sample(2000)
    assert set(samples.indices // n_envs) == {0, 1, 2, 4, 5}
    assert set(samples.indices % n_envs) == set(range(n_envs))
    np.testing.assert_array_equal(samples.next_observations[:, 0].numpy(), samples.observations[:, 0].numpy() + 1)
    np.testing.assert_array_equal(samples.observations[:, 1].numpy(), samples.indices % n_envs)
    with pytest.raises(ValueError, match="optimize_memory_usage"):
        PrioritizedReplayBuffer(
            6, OBS_SPACE, ACT_SPACE, optimize_memory_usage=True, handle_timeout_termination=False, n_steps=3
        )


def test_stock_dqn_n_steps_argument_with_custom_buffer_class():
    # Stock SB3 only forwards n_steps to its own NStepReplayBuffer: with a custom class it warns and builds 1-step.
    with pytest.warns(UserWarning, match="n_steps=3"):
        model = DQN("MlpPolicy", "CartPole-v1", n_steps=3, replay_buffer_class=PrioritizedReplayBuffer, device="cpu")
    assert isinstance(model.replay_buffer, PrioritizedReplayBuffer) and model.replay_buffer.n_steps == 1


@pytest.mark.parametrize("n_envs", [1, 3])
def test_n_step_returns_equal_sb3_n_step_buffer(n_envs):
    kwargs = dict(device="cpu", n_envs=n_envs)
    ours = PrioritizedReplayBuffer(7 * n_envs, OBS_SPACE, ACT_SPACE, n_steps=3, gamma=0.9, **kwargs)
    stock = NStepReplayBuffer(7 * n_envs, OBS_SPACE, ACT_SPACE, n_steps=3, gamma=0.9, **kwargs)
    for buffer in (ours, stock):
        _fill(buffer, 11, done_every=4, timeout_every=5)
    batch_inds = np.tile(np.arange(7), 3)
    np.random.seed(3)
    expected = stock._get_samples(batch_inds)
    np.random.seed(3)
    env_inds = np.random.randint(0, n_envs, size=batch_inds.shape)
    got = ours.get_samples_at(batch_inds, env_inds)
    for name in ReplayBufferSamples._fields:
        th.testing.assert_close(getattr(got, name), getattr(expected, name))
    samples = ours.sample(16)
    assert samples.discounts is not None and samples.discounts.shape == (16, 1)


def test_one_step_samples_equal_sb3_replay_buffer():
    stock = ReplayBuffer(12, OBS_SPACE, ACT_SPACE, device="cpu", n_envs=3)
    ours = PrioritizedReplayBuffer(12, OBS_SPACE, ACT_SPACE, device="cpu", n_envs=3)
    for buffer in (ours, stock):
        _fill(buffer, 6, done_every=3, timeout_every=2)
    batch_inds = np.array([0, 1, 2, 3, 3, 1])
    np.random.seed(4)
    expected = stock._get_samples(batch_inds)
    np.random.seed(4)
    got = ours.get_samples_at(batch_inds, np.random.randint(0, 3, size=6))
    for name in ReplayBufferSamples._fields:
        if getattr(expected, name) is None:
            assert getattr(got, name) is None
        else:
            th.testing.assert_close(getattr(got, name), getattr(expected, name))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 30))
def test_newest_indices_always_hold_the_latest_transition(n_envs, positions, n_adds):
    buffer = PrioritizedReplayBuffer(positions * n_envs, OBS_SPACE, ACT_SPACE, device="cpu", n_envs=n_envs)
    _fill(buffer, n_adds)
    batch_inds, env_inds = newest_indices(buffer)
    np.testing.assert_array_equal(env_inds, np.arange(n_envs))
    np.testing.assert_array_equal(buffer.observations[batch_inds, env_inds, 0], n_adds - 1)


def test_newest_indices_rejects_empty_buffer():
    with pytest.raises(ValueError, match="empty"):
        newest_indices(ReplayBuffer(4, OBS_SPACE, ACT_SPACE, device="cpu"))


def test_stock_dqn_trains_and_round_trips_the_buffer(tmp_path):
    model = DQN(
        "MlpPolicy",
        "CartPole-v1",
        learning_starts=64,
        batch_size=32,
        buffer_size=500,
        replay_buffer_class=PrioritizedReplayBuffer,
        replay_buffer_kwargs=dict(n_steps=3, gamma=0.99, alpha=0.5),
        device="cpu",
        seed=0,
    )
    model.learn(300)
    buffer = model.replay_buffer
    assert isinstance(buffer, PrioritizedReplayBuffer) and buffer.n_steps == 3
    samples = buffer.sample(32)
    buffer.update_priorities(samples.indices, np.linspace(0.0, 3.0, 32))
    model.save_replay_buffer(tmp_path / "buffer.pkl")
    other = DQN("MlpPolicy", "CartPole-v1", buffer_size=500, device="cpu")
    other.load_replay_buffer(tmp_path / "buffer.pkl")
    loaded = other.replay_buffer
    assert isinstance(loaded, PrioritizedReplayBuffer)
    assert loaded.max_priority == buffer.max_priority > 1.0
    assert loaded.alpha == 0.5 and loaded.tree.total == pytest.approx(buffer.tree.total)
    np.testing.assert_array_equal(loaded.tree.get(np.arange(500)), buffer.tree.get(np.arange(500)))
    other.learn(100, reset_num_timesteps=False)
