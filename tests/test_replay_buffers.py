import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
