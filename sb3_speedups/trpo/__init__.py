"""TRPO (sb3-contrib) with a hand-derived natural-gradient step."""

from sb3_speedups.trpo.trpo import TRPO

__all__ = ["TRPO"]
