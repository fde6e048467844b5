"""Fast drop-in CrossQ (sb3-contrib's CrossQ: batch-renormalised critics, no target networks)."""

from sb3_speedups.crossq.crossq import CrossQ

__all__ = ["CrossQ"]
