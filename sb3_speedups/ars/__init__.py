"""ARS (sb3-contrib's Augmented Random Search) with every candidate of an iteration evaluated at once."""

from sb3_speedups.ars.ars import ARS

__all__ = ["ARS"]
