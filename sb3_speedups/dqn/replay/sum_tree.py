"""Vectorised sum tree for proportional prioritised replay (Schaul et al., 2016)."""

import numpy as np


class SumTree:
    """
    Binary sum tree over ``capacity`` non-negative priorities, stored in one flat array.

    Updates and prefix-sum searches are batched: every tree level is processed with one numpy operation,
    so there is no per-sample Python loop.

    :param capacity: Number of leaves (priorities).
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._leaf_base = 1 << max(0, int(np.ceil(np.log2(capacity))))
        self._depth = int(np.log2(self._leaf_base))
        self._nodes = np.zeros(2 * self._leaf_base, dtype=np.float64)

    @property
    def total(self) -> float:
        """Sum of all priorities."""
        return float(self._nodes[1])

    def get(self, indices: np.ndarray) -> np.ndarray:
        """
        Priorities at the given leaf indices.

        :param indices: Leaf indices in ``[0, capacity)``.
        :return: Their priorities.
        """
        return self._nodes[self._leaf_base + np.asarray(indices, dtype=np.int64)]

    def update(self, indices: np.ndarray, priorities: np.ndarray) -> None:
        """
        Set priorities at the given leaves (the last value wins for repeated indices) and refresh all sums.

        :param indices: Leaf indices in ``[0, capacity)``.
        :param priorities: Non-negative priorities, one per index.
        """
        indices = np.asarray(indices, dtype=np.int64).ravel()
        priorities = np.asarray(priorities, dtype=np.float64).ravel()
        if np.any(priorities < 0):
            raise ValueError("priorities must be non-negative")
        nodes = self._leaf_base + indices
        self._nodes[nodes] = priorities
        # Repeated parents are harmless: each write of a parent stores the same sum of its two children.
        nodes = np.unique(nodes) // 2
        for _ in range(self._depth):
            self._nodes[nodes] = self._nodes[2 * nodes] + self._nodes[2 * nodes + 1]
            nodes //= 2

    def find(self, values: np.ndarray) -> np.ndarray:
        """
        Leaf index for each prefix-sum value: the smallest ``i`` with ``sum(p[:i + 1]) > value``.

        :param values: Values in ``[0, total)``.
        :return: Leaf indices, clipped to ``[0, capacity)``.
        """
        values = np.asarray(values, dtype=np.float64).copy()
        nodes = np.ones(values.shape, dtype=np.int64)
        for _ in range(self._depth):
            left = 2 * nodes
            left_sum = self._nodes[left]
            go_right = values >= left_sum
            values -= np.where(go_right, left_sum, 0.0)
            nodes = left + go_right
        return np.minimum(nodes - self._leaf_base, self.capacity - 1)
