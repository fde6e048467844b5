"""Picklable schedules (SB3 calls them with ``progress_remaining``, going from 1 to 0)."""

from __future__ import annotations


class LinearSchedule:
    """
    Linear decay from ``initial_value`` (start of training) to 0 (end), as the RL Zoo's ``lin_<value>``.

    :param initial_value: value at ``progress_remaining == 1``
    """

    def __init__(self, initial_value: float) -> None:
        self.initial_value = float(initial_value)

    def __call__(self, progress_remaining: float) -> float:
        return progress_remaining * self.initial_value

    def __repr__(self) -> str:
        return f"lin_{self.initial_value}"


class ConstantSchedule:
    """
    A constant value, as a picklable callable.

    :param value: the value returned for any progress
    """

    def __init__(self, value: float) -> None:
        self.value = float(value)

    def __call__(self, progress_remaining: float) -> float:
        return self.value

    def __repr__(self) -> str:
        return str(self.value)
