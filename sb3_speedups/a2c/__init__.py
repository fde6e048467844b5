"""Fast drop-in A2C."""

from sb3_speedups.a2c.a2c import A2C

__all__ = ["A2C"]
